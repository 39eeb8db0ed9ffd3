"""Typed configuration from TOML, and one clear error line per mistake.

`load_config(path)` returns a frozen `Config` or raises `ConfigError` whose
message names the file and the key. Unknown keys are errors. This module
knows nothing of the daemon that uses it.
"""

from __future__ import annotations

import hmac
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from edge.api.policy import DEFAULT_MAX_OUTPUT_TOKENS, MEDIA_SCHEMES, ForwardPolicy
from edge.observe.tracing import EXPORTERS, TracingConfig
from edge.stream.sentinel import DEFAULT_SENTINELS
from edge.stream.toolcall import TOOL_VALIDATION_MODES, ToolValidation
from edge.stream.toolparse import DEFAULT_FORMATS, FORMATS

REASONING_PARSERS = ("none", "think", "think_start")
# The node protocol carries max_tokens as a uint32.
_MAX_UINT32 = 2**32 - 1


class ConfigError(Exception):
    """A configuration mistake; the message is one line naming the file and key."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    listen: str = "127.0.0.1:8080"
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    drain_timeout_s: float = 30.0
    max_body_bytes: int = 4 * 1024 * 1024
    # SSE comment sent while waiting for the first token; 0 = never.
    keepalive_s: float = 15.0
    # How often every node is asked for its models (health, /readyz, routing).
    node_refresh_s: float = 5.0
    # Client connections served at once; 0 = derived from the file-descriptor limit.
    max_connections: int = 0
    # A connection with no request in progress is closed this long after it went
    # idle; the next request's head must be complete by then (slow heads too).
    idle_timeout_s: float = 5.0
    # Time the edge waits on the client for one HTTP/1.1 request body: past it, 408.
    body_timeout_s: float = 60.0
    # Worker processes serving the listen address (edge.process.supervisor); 1 = one process.
    workers: int = 1


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = "INFO"
    format: str = "text"
    # Lines waiting for a slow reader of stderr, at most (edge.observe.logwriter): the rest
    # are dropped.
    queue_bytes: int = 1024 * 1024


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    first_event_s: float = 120.0
    idle_s: float = 60.0
    total_s: float = 900.0
    # A client that reads nothing while this many seconds of output wait is gone.
    slow_client_s: float = 30.0


ROUTING_POLICIES = ("least_loaded", "affinity")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How runs are spread over nodes, retried, and kept off failing nodes (`[routing]`)."""

    # least_loaded: the node with the fewest runs in flight; affinity: the session's
    # node (X-Session-Id, else the request's `user`) while its load stays bounded.
    policy: str = "least_loaded"
    # Retries of a run that could not start (on another node), before the first byte.
    retries: int = 2
    # Base of the jittered exponential backoff between retries.
    retry_backoff_s: float = 0.05
    # Run failures in a row that open a node's circuit breaker.
    breaker_failures: int = 5
    # How long an open breaker keeps new runs off the node before one probe run.
    breaker_cooldown_s: float = 5.0


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The queue of requests waiting for a free node slot (`[admission]`)."""

    # Requests waiting at once; one more is answered 503 overloaded (0: no queue).
    max_queue: int = 1000
    # How long a request may wait for a slot before 503 overloaded.
    queue_timeout_s: float = 30.0
    # Bytes the requests queued and running may hold at once, as parsed (each request's
    # estimate: edge.api.footprint); one that would pass it is answered 503 overloaded.
    memory_budget_bytes: int = 512 * 1024 * 1024


# A key's name is a metric label and a log field: short, plain.
_KEY_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True, slots=True)
class KeyConfig:
    """One API key (`[[keys]]`): its name, its secret and its limits (None: no limit).

    The secret is kept out of `repr` (a config printed or logged never shows it).
    """

    name: str
    secret: str = field(repr=False)
    # Requests and tokens per minute, streams (requests in flight) at once.
    rpm: int | None = None
    tpm: int | None = None
    max_streams: int | None = None
    # The models this key may use; None: every model.
    models: tuple[str, ...] | None = None

    @property
    def limited(self) -> bool:
        """Whether any counted limit applies (and so the rate-limit headers are sent)."""
        return self.rpm is not None or self.tpm is not None or self.max_streams is not None


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Where the keys' counters live (`[limits]`): Redis, else this edge's workers."""

    # redis://HOST:PORT/DB (or rediss://, unix://): limits shared by every edge using it.
    redis_url: str | None = None
    # Redis down or slow: true lets requests through, false answers 503.
    fail_open: bool = True
    # Prefix of every Redis key the edge writes.
    key_prefix: str = "iop-edge:"
    # Deadline of one Redis call.
    redis_timeout_s: float = 0.25
    # A `max_streams` lease (Redis, the workers' shared file) expires this long after it
    # was last renewed: a stream whose release failed (Redis unreachable) or whose
    # process hangs is given back within it. A live request renews its lease every
    # `lease_renew_s` (one store call per process per renewal, for all its leases).
    lease_s: float = 10.0
    lease_renew_s: float = 3.0


@dataclass(frozen=True, slots=True)
class NodeConfig:
    name: str
    address: str
    # Runs in flight at once on this node: None, the node's Describe max_runs
    # (its 0: no limit); 0: no limit whatever the node says.
    max_runs: int | None = None

    @property
    def embedded(self) -> bool:
        return self.address == "embedded"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Per-model settings (`[models.NAME]`): the output policy and the forwarding policy."""

    strict: bool = False
    stream_buffer: bool = False
    reasoning_parser: str = "none"
    tool_call_formats: tuple[str, ...] = DEFAULT_FORMATS
    # strict | report | off; None: derived per request (edge.stream.toolcheck).
    tool_validation: ToolValidation | None = None
    sentinels: tuple[str, ...] = DEFAULT_SENTINELS
    trace_stream: bool = False
    # Forwarding policy (edge.api.policy): a request asking for more is a 400.
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    # Not forwarded unless allowed: chat_template_kwargs.chat_template, ignore_eos.
    allow_chat_template: bool = False
    allow_ignore_eos: bool = False
    # Media URL schemes the node may be sent besides data: ("http", "https").
    media_url_schemes: tuple[str, ...] = ("data",)

    @property
    def forward_policy(self) -> ForwardPolicy:
        return ForwardPolicy(
            max_output_tokens=self.max_output_tokens,
            allow_chat_template=self.allow_chat_template,
            allow_ignore_eos=self.allow_ignore_eos,
            media_url_schemes=frozenset(self.media_url_schemes) | {"data"},
        )


DEFAULT_MODEL = ModelConfig()
# The simulated models write <think> into content like the models they stand for.
SIM_MODEL = ModelConfig(reasoning_parser="think")


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    nodes: tuple[NodeConfig, ...] = (NodeConfig("embedded", "embedded"),)
    models: Mapping[str, ModelConfig] = field(default_factory=dict)
    keys: tuple[KeyConfig, ...] = ()
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    source: str = "<defaults>"

    def model(self, name: str) -> ModelConfig:
        found = self.models.get(name)
        if found is not None:
            return found
        return SIM_MODEL if name.startswith("sim-") else DEFAULT_MODEL


class TableReader:
    """Reads one table, checking types and rejecting unknown keys."""

    def __init__(self, source: str, prefix: str, table: object) -> None:
        self.source = source
        self.prefix = prefix
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{prefix}] must be a table")
        self.table: dict[str, Any] = dict(table)

    def _key(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self._key(key)}: {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        if key not in self.table:
            return default
        value = self.table.pop(key)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(key, f"expected {_names(kinds)}, got a boolean")
        if not isinstance(value, kinds):
            raise self.fail(key, f"expected {_names(kinds)}, got {type(value).__name__}")
        return value

    def number(
        self, key: str, default: float, *, minimum: float = 0.0, maximum: float = 1e9
    ) -> float:
        value = float(self.get(key, (int, float), default))
        if not math.isfinite(value):
            raise self.fail(key, "must be a finite number")
        if value < minimum:
            raise self.fail(key, f"must be >= {minimum}")
        if value > maximum:
            raise self.fail(key, f"must be <= {maximum:g}")
        return value

    def strings(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.get(key, list, None)
        if value is None:
            return default
        if not all(isinstance(v, str) for v in value):
            raise self.fail(key, "expected a list of strings")
        return tuple(value)

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        value = str(self.get(key, str, default))
        if value not in choices:
            raise self.fail(key, f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    def integer(self, key: str, default: int, *, minimum: int = 0, maximum: int = 10**9) -> int:
        value: int = self.get(key, int, default)
        if not minimum <= value <= maximum:
            raise self.fail(key, f"must be between {minimum} and {maximum}, got {value}")
        return value

    def done(self) -> None:
        for key in self.table:
            raise ConfigError(f"{self.source}: unknown key {self._key(key)}")


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(
        {
            int: "an integer",
            float: "a number",
            str: "a string",
            bool: "a boolean",
            list: "a list",
            dict: "a table",
        }.get(k, k.__name__)
        for k in kinds
    )


def parse_config(doc: Mapping[str, Any], source: str) -> Config:
    root = TableReader(source, "", doc)
    srv, tmo = ServerConfig(), TimeoutsConfig()

    r = TableReader(source, "server", root.get("server", dict, {}))
    server = ServerConfig(
        listen=r.get("listen", str, srv.listen),
        api_keys=tuple(key.strip() for key in r.strings("api_keys", ())),
        api_keys_file=r.get("api_keys_file", str, None),
        drain_timeout_s=r.number("drain_timeout_s", srv.drain_timeout_s),
        max_body_bytes=int(r.number("max_body_bytes", srv.max_body_bytes, minimum=1024)),
        keepalive_s=r.number("keepalive_s", srv.keepalive_s),
        node_refresh_s=r.number("node_refresh_s", srv.node_refresh_s, minimum=0.05),
        max_connections=r.integer("max_connections", srv.max_connections),
        idle_timeout_s=r.number("idle_timeout_s", srv.idle_timeout_s, minimum=0.01, maximum=3600),
        body_timeout_s=r.number("body_timeout_s", srv.body_timeout_s, minimum=0.01, maximum=3600),
        workers=_workers(r),
    )
    _check(r, "listen", split_address, server.listen)
    if any(not key.strip() for key in server.api_keys):
        raise r.fail("api_keys", "an empty key would let anyone in")
    r.done()
    if server.api_keys_file is not None:
        server = ServerConfig(**{
            **{f: getattr(server, f) for f in server.__dataclass_fields__},
            "api_keys": server.api_keys + _read_keys(source, server.api_keys_file),
        })  # fmt: skip

    r = TableReader(source, "log", root.get("log", dict, {}))
    log = LogConfig(
        level=r.choice("level", "INFO", ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR")),
        format=r.choice("format", "text", ("text", "json")),
        queue_bytes=r.integer("queue_bytes", LogConfig().queue_bytes, minimum=16384, maximum=2**30),
    )
    r.done()

    r = TableReader(source, "timeouts", root.get("timeouts", dict, {}))
    timeouts = TimeoutsConfig(
        first_event_s=r.number("first_event_s", tmo.first_event_s, minimum=0.001),
        idle_s=r.number("idle_s", tmo.idle_s, minimum=0.001),
        total_s=r.number("total_s", tmo.total_s, minimum=0.001),
        slow_client_s=r.number("slow_client_s", tmo.slow_client_s, minimum=0.001),
    )
    r.done()

    rtg, adm = RoutingConfig(), AdmissionConfig()
    r = TableReader(source, "routing", root.get("routing", dict, {}))
    routing = RoutingConfig(
        policy=r.choice("policy", rtg.policy, ROUTING_POLICIES),
        retries=r.integer("retries", rtg.retries, maximum=10),
        retry_backoff_s=r.number("retry_backoff_s", rtg.retry_backoff_s, maximum=60),
        breaker_failures=r.integer("breaker_failures", rtg.breaker_failures, minimum=1),
        breaker_cooldown_s=r.number(
            "breaker_cooldown_s", rtg.breaker_cooldown_s, minimum=0.01, maximum=3600
        ),
    )
    r.done()

    r = TableReader(source, "admission", root.get("admission", dict, {}))
    admission = AdmissionConfig(
        max_queue=r.integer("max_queue", adm.max_queue, maximum=1_000_000),
        queue_timeout_s=r.number(
            "queue_timeout_s", adm.queue_timeout_s, minimum=0.001, maximum=3600
        ),
        memory_budget_bytes=r.integer(
            "memory_budget_bytes", adm.memory_budget_bytes, minimum=2**20, maximum=2**50
        ),
    )
    r.done()

    nodes: list[NodeConfig] = []
    raw_nodes = root.get("nodes", list, None)
    if raw_nodes is not None:
        for i, raw in enumerate(raw_nodes):
            r = TableReader(source, f"nodes[{i}]", raw)
            address = r.get("address", str, None)
            if address is None:
                raise r.fail("address", 'missing (HOST:PORT, "embedded" or openai+http://...)')
            name = r.get("name", str, address)
            if address != "embedded":
                _check(r, "address", check_node_address, address)
            max_runs = None
            if "max_runs" in r.table:
                max_runs = r.integer("max_runs", 0, maximum=1_000_000)
            r.done()
            if any(n.name == name for n in nodes):
                raise ConfigError(f"{source}: nodes[{i}].name: duplicate node name {name!r}")
            nodes.append(NodeConfig(name=name, address=address, max_runs=max_runs))

    keys = _keys(source, root.get("keys", list, []), server.api_keys)
    limits = _limits(source, root.get("limits", dict, {}))
    tracing = _tracing(source, root.get("tracing", dict, {}))

    models: dict[str, ModelConfig] = {}
    for name, raw in root.get("models", dict, {}).items():
        r = TableReader(source, f"models.{name}", raw)
        base = SIM_MODEL if name.startswith("sim-") else DEFAULT_MODEL
        formats = r.strings("tool_call_formats", base.tool_call_formats)
        for fmt in formats:
            if fmt not in FORMATS:
                raise r.fail(
                    "tool_call_formats",
                    f"unknown format {fmt!r} (known: {', '.join(FORMATS)})",
                )
        models[name] = ModelConfig(
            strict=r.get("strict", bool, base.strict),
            stream_buffer=r.get("stream_buffer", bool, base.stream_buffer),
            reasoning_parser=r.choice("reasoning_parser", base.reasoning_parser, REASONING_PARSERS),
            tool_call_formats=formats,
            tool_validation=_tool_validation(r, base.tool_validation),
            sentinels=r.strings("sentinels", base.sentinels),
            trace_stream=r.get("trace_stream", bool, base.trace_stream),
            max_output_tokens=r.integer(
                "max_output_tokens", base.max_output_tokens, minimum=1, maximum=_MAX_UINT32
            ),
            allow_chat_template=r.get("allow_chat_template", bool, base.allow_chat_template),
            allow_ignore_eos=r.get("allow_ignore_eos", bool, base.allow_ignore_eos),
            media_url_schemes=_media_schemes(r, base.media_url_schemes),
        )
        r.done()
    root.done()
    return Config(
        server=server,
        log=log,
        timeouts=timeouts,
        routing=routing,
        admission=admission,
        nodes=tuple(nodes) if raw_nodes is not None else Config().nodes,
        models=models,
        keys=keys,
        limits=limits,
        tracing=tracing,
        source=source,
    )


def _keys(source: str, raw_keys: list[Any], api_keys: tuple[str, ...]) -> tuple[KeyConfig, ...]:
    """`[[keys]]`: each with a name and exactly one of key, key_env, key_file.

    Messages name the entry and the setting, never the secret.
    """
    keys: list[KeyConfig] = []
    for i, raw in enumerate(raw_keys):
        r = TableReader(source, f"keys[{i}]", raw)
        name = r.get("name", str, None)
        if name is None:
            raise r.fail("name", "missing (a name for logs and metrics)")
        if not _KEY_NAME.match(name):
            raise r.fail("name", "expected 1 to 64 of A-Z a-z 0-9 . _ -")
        if name == "api_keys":
            raise r.fail("name", "'api_keys' names the keys of [server] api_keys; pick another")
        given = [k for k in ("key", "key_env", "key_file") if k in r.table]
        if len(given) != 1:
            raise r.fail("key", "give exactly one of key, key_env, key_file")
        secret = _secret(source, r, given[0])
        if any(not 1 <= ord(c) < 127 or c.isspace() for c in secret):
            raise r.fail(given[0], "the key must be printable ASCII without spaces")
        rpm, tpm, streams = (
            r.integer(k, 0, minimum=1, maximum=1_000_000_000) if k in r.table else None
            for k in ("rpm", "tpm", "max_streams")
        )
        models = r.strings("models", ()) if "models" in r.table else None
        r.done()
        if any(k.name == name for k in keys):
            raise ConfigError(f"{source}: keys[{i}].name: duplicate key name {name!r}")
        if any(hmac_equal(k.secret, secret) for k in keys) or secret in api_keys:
            raise ConfigError(f"{source}: keys[{i}].{given[0]}: the same key is configured twice")
        keys.append(KeyConfig(name, secret, rpm, tpm, streams, models))
    return tuple(keys)


def hmac_equal(a: str, b: str) -> bool:
    """Whether two secrets are equal, in time that does not tell where they differ."""
    return hmac.compare_digest(a.encode(), b.encode())


def _secret(source: str, r: TableReader, how: str) -> str:
    """The secret of a `[[keys]]` entry, from the config, the environment or a file."""
    value: str = r.get(how, str, "")
    if how == "key_env":
        secret = os.environ.get(value, "").strip()
        if not secret:
            raise r.fail(how, f"the environment variable {value!r} is not set or empty")
        return secret
    if how == "key_file":
        base = Path(source).parent if source != "<defaults>" else Path(".")
        try:
            secret = (base / value).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise r.fail(how, f"cannot read {value}: {exc.strerror or exc}") from None
        if not secret:
            raise r.fail(how, f"{value} holds no key")
        return secret
    if not value.strip():
        raise r.fail(how, "an empty key would let anyone in")
    return value.strip()


def _limits(source: str, raw: object) -> LimitsConfig:
    lim = LimitsConfig()
    r = TableReader(source, "limits", raw)
    limits = LimitsConfig(
        redis_url=r.get("redis_url", str, None),
        fail_open=r.get("fail_open", bool, lim.fail_open),
        key_prefix=r.get("key_prefix", str, lim.key_prefix),
        redis_timeout_s=r.number("redis_timeout_s", lim.redis_timeout_s, minimum=0.001, maximum=60),
        lease_s=r.number("lease_s", lim.lease_s, minimum=0.05, maximum=3600),
        lease_renew_s=r.number("lease_renew_s", lim.lease_renew_s, minimum=0.01, maximum=3600),
    )
    if limits.lease_renew_s * 2 > limits.lease_s:
        raise r.fail("lease_renew_s", "must be at most half of lease_s (a renewal may be late)")
    if limits.redis_url is not None:
        scheme = urlsplit(limits.redis_url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise r.fail("redis_url", "expected redis://HOST:PORT/DB, rediss://... or unix://...")
    r.done()
    return limits


def _tracing(source: str, raw: object) -> TracingConfig:
    """`[tracing]`: each key unset defers to the OTEL_* environment (edge.observe.tracing)."""
    r = TableReader(source, "tracing", raw)
    tracing = TracingConfig(
        enabled=r.get("enabled", bool, None),
        exporter=r.choice("exporter", "otlp", EXPORTERS),
        endpoint=r.get("endpoint", str, None),
        sample_ratio=(
            r.number("sample_ratio", 1.0, maximum=1.0) if "sample_ratio" in r.table else None
        ),
        capture_content=r.get("capture_content", bool, None),
    )
    if tracing.endpoint is not None:
        parts = urlsplit(tracing.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise r.fail("endpoint", "expected http://HOST:PORT (an OTLP/HTTP receiver)")
    r.done()
    return tracing


MAX_WORKERS = 256


def parse_workers(value: object) -> int:
    """`workers`: a count from 1 to MAX_WORKERS, or "auto" (the CPUs this process may use)."""
    if value == "auto":
        return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f'expected a number of processes or "auto", got {value!r}')
    if not 1 <= value <= MAX_WORKERS:
        raise ValueError(f"must be between 1 and {MAX_WORKERS}, got {value}")
    return value


def _workers(r: TableReader) -> int:
    if "workers" not in r.table:
        return 1
    raw = r.table.pop("workers")
    try:
        return parse_workers(raw)
    except ValueError as exc:
        raise r.fail("workers", str(exc)) from None


def _tool_validation(r: TableReader, default: ToolValidation | None) -> ToolValidation | None:
    """`tool_validation`: strict, report or off; absent, derived per request."""
    if "tool_validation" not in r.table:
        return default
    return cast(ToolValidation, r.choice("tool_validation", "", TOOL_VALIDATION_MODES))


def _media_schemes(r: TableReader, default: tuple[str, ...]) -> tuple[str, ...]:
    """`media_url_schemes`, lower case; only data, http and https can be allowed."""
    schemes = tuple(s.lower().removesuffix(":") for s in r.strings("media_url_schemes", default))
    for scheme in schemes:
        if scheme not in MEDIA_SCHEMES:
            raise r.fail(
                "media_url_schemes",
                f"unsupported scheme {scheme!r} (allowed: {', '.join(MEDIA_SCHEMES)})",
            )
    return schemes


def _check(r: TableReader, key: str, check: Callable[[str], object], value: str) -> None:
    """`check(value)`'s ValueError, as the ConfigError naming `key`."""
    try:
        check(value)
    except ValueError as exc:
        raise r.fail(key, str(exc)) from None


def check_node_address(address: str) -> None:
    """Raise ValueError unless `address` is HOST:PORT or openai+http(s)://HOST:PORT/PATH."""
    if upstream_url(address) is None:
        split_address(address)


def upstream_url(address: str) -> str | None:
    """The server URL of an `openai+http(s)://HOST:PORT/PATH` node address; None for others.

    Such a node is served in-process by `edge.nodes.upstream`; raises ValueError
    when the address has the scheme but no host or a bad port.
    """
    if not address.startswith(("openai+http://", "openai+https://")):
        return None
    url = address.removeprefix("openai+")
    try:
        parts = urlsplit(url)
        valid = bool(parts.hostname) and (parts.port is None or parts.port >= 0)
    except ValueError:  # a port that is not a number or out of range
        valid = False
    if not valid:
        raise ValueError(f"expected openai+http://HOST:PORT/v1, got {address!r}")
    return url


def split_address(value: str) -> tuple[str, int]:
    """`HOST:PORT` as (host, port); raises ValueError with a readable message."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _read_keys(source: str, path: str) -> tuple[str, ...]:
    """API keys from a file: one per line; blank lines and # comments skipped."""
    base = Path(source).parent if source != "<defaults>" else Path(".")
    try:
        text = (base / path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"{source}: server.api_keys_file: cannot read {path}: {exc.strerror or exc}"
        ) from None
    stripped = (line.strip() for line in text.splitlines())
    keys = tuple(line for line in stripped if line and not line.startswith("#"))
    if not keys:
        raise ConfigError(f"{source}: server.api_keys_file: {path} holds no key")
    return keys


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML document at `path`; ConfigError when it cannot be read or parsed."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def load_config(path: Path) -> Config:
    """Read `path`; a missing file is an error (the caller decides about defaults)."""
    return parse_config(read_toml(path), str(path))
