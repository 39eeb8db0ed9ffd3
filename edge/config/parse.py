"""A TOML document into a `Config`: every table read, checked, and no unknown key.

`load_config(path)` returns a frozen `Config` or raises `ConfigError` whose message
names the file and the key. Knows nothing of the daemon that uses the result.
"""

from __future__ import annotations

import hashlib
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

from edge.api.policy import MEDIA_SCHEMES
from edge.config.address import check_node_address, split_address, upstream_url
from edge.config.files import ConfigFiles, files_digest
from edge.config.keys import _beside, _keys, _read_keys
from edge.config.routing import ROUTING_POLICIES, AdmissionConfig, NodeConfig, RoutingConfig
from edge.config.schema import (
    DEFAULT_MODEL,
    REASONING_PARSERS,
    RESPONSE_STORES,
    SIM_MODEL,
    Config,
    LimitsConfig,
    LogConfig,
    ModelConfig,
    ResponsesConfig,
    ServerConfig,
    TimeoutsConfig,
)
from edge.config.toml import ConfigError, TableReader, parse_toml, read_bytes, read_toml
from edge.observe.tracing import EXPORTERS, TracingConfig
from edge.stream.toolcall import TOOL_VALIDATION_MODES, ToolValidation
from edge.stream.toolparse import FORMATS

# The node protocol carries max_tokens as a uint32.
_MAX_UINT32 = 2**32 - 1
_T = TypeVar("_T")


def parse_config(doc: Mapping[str, Any], source: str, files: ConfigFiles | None = None) -> Config:
    """Every table in the order a mistake is reported in; then no key is left over. The
    files it names are read through `files` (default: the disk)."""
    files = ConfigFiles() if files is None else files
    root = TableReader(source, "", doc)
    server = _table(source, root, "server", _server)
    if server.api_keys_file is not None:
        more = _read_keys(source, server.api_keys_file, files)
        server = replace(server, api_keys=server.api_keys + more)
    log = _table(source, root, "log", _log)
    timeouts = _table(source, root, "timeouts", _timeouts)
    routing = _table(source, root, "routing", _routing)
    admission = _table(source, root, "admission", _admission)
    raw_nodes = root.get("nodes", list, None)
    nodes = _nodes(source, raw_nodes, files) if raw_nodes is not None else Config().nodes
    keys = _keys(source, root.get("keys", list, []), server.api_keys, files)
    limits = _table(source, root, "limits", _limits)
    tracing = _table(source, root, "tracing", _tracing)
    responses = _table(source, root, "responses", _responses)
    if responses.path is not None:
        base = Path(source).parent if source != "<defaults>" else Path(".")
        responses = replace(responses, path=str(base / responses.path))
    if responses.store == "redis" and (responses.redis_url or limits.redis_url) is None:
        raise ConfigError(
            f'{source}: responses.store: "redis" needs responses.redis_url or limits.redis_url'
        )
    models = _models(source, root.get("models", dict, {}))
    root.done()
    return Config(
        server=server,
        log=log,
        timeouts=timeouts,
        routing=routing,
        admission=admission,
        nodes=nodes,
        models=models,
        keys=keys,
        limits=limits,
        tracing=tracing,
        responses=responses,
        source=source,
    )


def _table(source: str, root: TableReader, name: str, read: Callable[[TableReader], _T]) -> _T:
    """The table `name`, as `read` makes it of its reader; then no key of it is left over."""
    r = TableReader(source, name, root.get(name, dict, {}))
    settings = read(r)
    r.done()
    return settings


def _server(r: TableReader) -> ServerConfig:
    """`[server]`, but for the keys of `api_keys_file` (read once the table is done)."""
    srv = ServerConfig()
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
        cors_allow_origins=tuple(
            _origin(r, origin) for origin in r.strings("cors_allow_origins", ())
        ),
    )
    _check(r, "listen", split_address, server.listen)
    if any(not key.strip() for key in server.api_keys):
        raise r.fail("api_keys", "an empty key would let anyone in")
    return server


def _log(r: TableReader) -> LogConfig:
    return LogConfig(
        level=r.choice("level", "INFO", ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR")),
        format=r.choice("format", "text", ("text", "json")),
        queue_bytes=r.integer("queue_bytes", LogConfig().queue_bytes, minimum=16384, maximum=2**30),
    )


def _timeouts(r: TableReader) -> TimeoutsConfig:
    tmo = TimeoutsConfig()
    return TimeoutsConfig(
        first_event_s=r.number("first_event_s", tmo.first_event_s, minimum=0.001),
        idle_s=r.number("idle_s", tmo.idle_s, minimum=0.001),
        total_s=r.number("total_s", tmo.total_s, minimum=0.001),
        slow_client_s=r.number("slow_client_s", tmo.slow_client_s, minimum=0.001),
        slow_client_backlog_chars=r.integer(
            "slow_client_backlog_chars", tmo.slow_client_backlog_chars, minimum=65536, maximum=2**40
        ),
    )


def _routing(r: TableReader) -> RoutingConfig:
    rtg = RoutingConfig()
    return RoutingConfig(
        policy=r.choice("policy", rtg.policy, ROUTING_POLICIES),
        retries=r.integer("retries", rtg.retries, maximum=10),
        retry_backoff_s=r.number("retry_backoff_s", rtg.retry_backoff_s, maximum=60),
        migrations=r.integer("migrations", rtg.migrations, maximum=10),
        breaker_failures=r.integer("breaker_failures", rtg.breaker_failures, minimum=1),
        breaker_cooldown_s=r.number(
            "breaker_cooldown_s", rtg.breaker_cooldown_s, minimum=0.01, maximum=3600
        ),
        watch_heartbeat_s=r.number(
            "watch_heartbeat_s", rtg.watch_heartbeat_s, minimum=0.1, maximum=60
        ),
        cache_blocks=r.integer("cache_blocks", rtg.cache_blocks, minimum=1, maximum=1 << 20),
        cache_load_factor=r.number(
            "cache_load_factor", rtg.cache_load_factor, minimum=1.0, maximum=100
        ),
        cache_share_factor=r.number(
            "cache_share_factor", rtg.cache_share_factor, minimum=1.0, maximum=100
        ),
        cache_threshold=r.number("cache_threshold", rtg.cache_threshold, minimum=0, maximum=1),
    )


def _admission(r: TableReader) -> AdmissionConfig:
    adm = AdmissionConfig()
    return AdmissionConfig(
        max_queue=r.integer("max_queue", adm.max_queue, maximum=1_000_000),
        queue_timeout_s=r.number(
            "queue_timeout_s", adm.queue_timeout_s, minimum=0.001, maximum=3600
        ),
        memory_budget_bytes=r.integer(
            "memory_budget_bytes", adm.memory_budget_bytes, minimum=2**20, maximum=2**50
        ),
    )


def _nodes(source: str, raw_nodes: list[Any], files: ConfigFiles) -> tuple[NodeConfig, ...]:
    """`[[nodes]]`: each with an address; names are unique (the address by default)."""
    nodes: list[NodeConfig] = []
    for i, raw in enumerate(raw_nodes):
        r = TableReader(source, f"nodes[{i}]", raw)
        address = r.get("address", str, None)
        if address is None:
            raise r.fail("address", 'missing (HOST:PORT, "embedded" or openai+http://...)')
        name = r.get("name", str, address)
        if address != "embedded":
            _check(r, "address", check_node_address, address)
        max_runs = r.integer("max_runs", None, maximum=1_000_000)
        node = NodeConfig(name=name, address=address, max_runs=max_runs)
        node = _node_access(source, r, node, files)
        r.done()
        if any(n.name == name for n in nodes):
            raise ConfigError(f"{source}: nodes[{i}].name: duplicate node name {name!r}")
        nodes.append(node)
    return tuple(nodes)


_NODE_FILES = ("token_file", "ca_file", "cert_file", "key_file")


def _node_access(source: str, r: TableReader, node: NodeConfig, files: ConfigFiles) -> NodeConfig:
    """A node's credentials: the token file, TLS and its files (paths relative to the
    config file), each file read now, so that one that cannot be read, an empty token or
    a certificate that does not load is this configuration's error (a reload with it is
    refused). `files_digest` is what they held."""
    paths = {
        key: str(_beside(source, value))
        for key in _NODE_FILES
        if (value := r.get(key, str, None)) is not None
    }
    server_name = r.get("server_name", str, None)
    tls = r.get("tls", bool, False) or server_name is not None
    tls = tls or any(key in paths for key in ("ca_file", "cert_file", "key_file"))
    if "key_file" in paths and "cert_file" not in paths:
        raise r.fail("key_file", "needs cert_file")
    in_process = node.address == "embedded" or upstream_url(node.address) is not None
    if in_process and (paths or tls):
        raise r.fail("address", "a node served in-process takes no token_file nor TLS")
    digest = hashlib.sha256()
    for key, path in paths.items():
        try:
            data = files.bytes_of(Path(path))
        except OSError as exc:
            raise r.fail(key, f"cannot read {path}: {exc.strerror or exc}") from None
        if key == "token_file" and not data.strip():
            raise r.fail(key, f"{path} is empty")
        digest.update(key.encode() + b"\0" + hashlib.sha256(data).digest())
    if "cert_file" in paths:
        try:
            ssl.create_default_context().load_cert_chain(paths["cert_file"], paths.get("key_file"))
        except (OSError, ssl.SSLError) as exc:
            raise r.fail("cert_file", f"cannot load it (with its key): {exc}") from None
    if "ca_file" in paths:
        try:
            ssl.create_default_context(cafile=paths["ca_file"])
        except (OSError, ssl.SSLError) as exc:
            raise r.fail("ca_file", f"cannot load it: {exc}") from None
    return replace(
        node,
        token_file=paths.get("token_file"),
        tls=tls,
        ca_file=paths.get("ca_file"),
        cert_file=paths.get("cert_file"),
        key_file=paths.get("key_file"),
        server_name=server_name,
        files_digest=digest.hexdigest() if paths else "",
    )


def _models(source: str, raw_models: dict[str, Any]) -> dict[str, ModelConfig]:
    """`[models.NAME]`: a key left out keeps the default (`SIM_MODEL`'s for `sim-*`)."""
    models: dict[str, ModelConfig] = {}
    for name, raw in raw_models.items():
        r = TableReader(source, f"models.{name}", raw)
        base = SIM_MODEL if name.startswith("sim-") else DEFAULT_MODEL
        models[name] = ModelConfig(
            strict=r.get("strict", bool, base.strict),
            stream_buffer=r.get("stream_buffer", bool, base.stream_buffer),
            reasoning_parser=r.choice("reasoning_parser", base.reasoning_parser, REASONING_PARSERS),
            tool_call_formats=_formats(r, base.tool_call_formats),
            tool_validation=cast(
                "ToolValidation | None",
                r.choice("tool_validation", base.tool_validation, TOOL_VALIDATION_MODES),
            ),
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
    return models


def _limits(r: TableReader) -> LimitsConfig:
    lim = LimitsConfig()
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
    return limits


def _responses(r: TableReader) -> ResponsesConfig:
    rsp = ResponsesConfig()
    responses = ResponsesConfig(
        store=r.choice("store", rsp.store, RESPONSE_STORES),
        path=r.get("path", str, None),
        redis_url=r.get("redis_url", str, None),
        key_prefix=r.get("key_prefix", str, rsp.key_prefix),
        redis_timeout_s=r.number("redis_timeout_s", rsp.redis_timeout_s, minimum=0.001, maximum=60),
        max_responses=r.integer("max_responses", rsp.max_responses, minimum=1, maximum=10**9),
        max_bytes=r.integer("max_bytes", rsp.max_bytes, minimum=2**16, maximum=2**44),
        max_response_bytes=r.integer(
            "max_response_bytes", rsp.max_response_bytes, minimum=1024, maximum=2**31
        ),
        ttl_s=r.number("ttl_s", rsp.ttl_s, minimum=1.0, maximum=10 * 365 * 86400.0),
        per_key_max_responses=r.integer("per_key_max_responses", None, minimum=1, maximum=10**9),
        per_key_max_bytes=r.integer("per_key_max_bytes", None, minimum=1024, maximum=2**44),
    )
    if responses.max_response_bytes > responses.max_bytes:
        raise r.fail("max_response_bytes", "must be at most max_bytes")
    if responses.key_max_responses > responses.max_responses:
        raise r.fail("per_key_max_responses", "must be at most max_responses")
    if responses.key_max_bytes > responses.max_bytes:
        raise r.fail("per_key_max_bytes", "must be at most max_bytes")
    if responses.path is not None and not responses.path:
        raise r.fail("path", "must not be empty")
    if responses.redis_url is not None:
        scheme = urlsplit(responses.redis_url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise r.fail("redis_url", "expected redis://HOST:PORT/DB, rediss://... or unix://...")
    return responses


def _tracing(r: TableReader) -> TracingConfig:
    """`[tracing]`: each key unset defers to the OTEL_* environment (edge.observe.tracing)."""
    tracing = TracingConfig(
        enabled=r.get("enabled", bool, None),
        exporter=r.choice("exporter", "otlp", EXPORTERS),
        endpoint=r.get("endpoint", str, None),
        sample_ratio=r.number("sample_ratio", None, maximum=1.0),
        capture_content=r.get("capture_content", bool, None),
    )
    if tracing.endpoint is not None:
        parts = urlsplit(tracing.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise r.fail("endpoint", "expected http://HOST:PORT (an OTLP/HTTP receiver)")
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
    raw = r.raw("workers", f'integer, 1 to {MAX_WORKERS}, or "auto"')
    if raw is None:
        return 1
    try:
        return parse_workers(raw)
    except ValueError as exc:
        raise r.fail("workers", str(exc)) from None


def _formats(r: TableReader, default: tuple[str, ...]) -> tuple[str, ...]:
    """`tool_call_formats`: each one the text tool-call parser knows."""
    formats = r.strings("tool_call_formats", default)
    for fmt in formats:
        if fmt not in FORMATS:
            raise r.fail(
                "tool_call_formats", f"unknown format {fmt!r} (known: {', '.join(FORMATS)})"
            )
    return formats


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


# An origin as browsers send it: scheme://host[:port], nothing after.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")


def _origin(r: TableReader, origin: str) -> str:
    """One of `cors_allow_origins`: "*", or an origin (lower case, as browsers send it)."""
    if origin == "*":
        return origin
    if _ORIGIN.fullmatch(origin.lower()) is None:
        raise r.fail(
            "cors_allow_origins",
            f"{origin!r} is not an origin: write scheme://host[:port], no path and no"
            ' trailing slash (e.g. "https://app.example.com"), or "*"',
        )
    return origin.lower()


def _check(r: TableReader, key: str, check: Callable[[str], object], value: str) -> None:
    """`check(value)`'s ValueError, as the ConfigError naming `key`."""
    try:
        check(value)
    except ValueError as exc:
        raise r.fail(key, str(exc)) from None


def load_config(path: Path) -> Config:
    """Read `path`; a missing file is an error (the caller decides about defaults)."""
    return parse_config(read_toml(path), str(path))


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """A configuration as read: the settings, the file's bytes and their digest (what
    a reload compares, and what `iop_edge_config_info` shows)."""

    config: Config
    data: bytes = b""
    digest: str = ""
    # The files it names, as read (edge.config.files): the digest covers them too.
    files: Mapping[str, bytes] = field(default_factory=dict)


def config_digest(data: bytes) -> str:
    """The digest of a configuration file: the first 16 hex digits of its sha256, as
    `sha256sum FILE | cut -c1-16` prints them."""
    return hashlib.sha256(data).hexdigest()[:16]


def load_config_file(
    path: Path, data: bytes | None = None, files: Mapping[str, bytes] | None = None
) -> LoadedConfig:
    """Read `path`, or parse `data` as its bytes (a copy read before: what a worker
    gets from its supervisor); the files it names (`api_keys_file`, `key_file`, a node's
    token and TLS files, relative to `path`) are read from disk, or taken from `files`
    (the supervisor's copy of them). The digest covers the file and those it names."""
    if data is None:
        data = read_bytes(path)
    reader = ConfigFiles(files)
    config = parse_config(parse_toml(data, path), str(path), reader)
    return LoadedConfig(config, data, files_digest(config_digest(data), reader.read), reader.read)
