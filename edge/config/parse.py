"""A TOML document into a `Config`: every table read, checked, and no unknown key.

Each key is read as its settings field says (type, default, bounds, choices:
`edge.config.spec`); what is here is what a field cannot say: the checks across keys
and tables, the files and addresses, the `[[nodes]]` entries. `load_config(path)`
returns a frozen `Config` or raises `ConfigError` whose message names the file and the
key. Knows nothing of the daemon that uses the result.
"""

from __future__ import annotations

import hashlib
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from edge.api.policy import MEDIA_SCHEMES
from edge.config.address import (
    check_node_address,
    parse_discover,
    parse_nameserver,
    split_address,
    upstream_url,
)
from edge.config.files import ConfigFiles, files_digest
from edge.config.keys import _beside, _keys, _read_keys
from edge.config.routing import AdmissionConfig, DiscoveryConfig, NodeConfig, RoutingConfig
from edge.config.schema import (
    DEFAULT_MODEL,
    MAX_WORKERS,
    SIM_MODEL,
    Config,
    LimitsConfig,
    LogConfig,
    ModelConfig,
    ResponsesConfig,
    ServerConfig,
    TimeoutsConfig,
)
from edge.config.spec import read_key, read_settings
from edge.config.toml import ConfigError, TableReader, parse_toml, read_bytes, read_toml
from edge.observe.tracing import TracingConfig
from edge.stream.toolparse import FORMATS

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
    log = _table(source, root, "log", lambda r: read_settings(r, LogConfig))
    timeouts = _table(source, root, "timeouts", lambda r: read_settings(r, TimeoutsConfig))
    routing = _table(source, root, "routing", lambda r: read_settings(r, RoutingConfig))
    admission = _table(source, root, "admission", lambda r: read_settings(r, AdmissionConfig))
    raw_nodes = root.get("nodes", list, None)
    nodes = _nodes(source, raw_nodes, files) if raw_nodes is not None else Config().nodes
    discovery = _table(source, root, "discovery", _discovery)
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
        discovery=discovery,
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
    server = read_settings(
        r,
        ServerConfig,
        checks={"api_keys": _stripped, "workers": _workers, "cors_allow_origins": _origins},
    )
    _check(r, "listen", split_address, server.listen)
    if any(not key for key in server.api_keys):
        raise r.fail("api_keys", "an empty key would let anyone in")
    return server


def _nodes(source: str, raw_nodes: list[Any], files: ConfigFiles) -> tuple[NodeConfig, ...]:
    """`[[nodes]]`: each with an address, or a DNS name its nodes are found by (`discover`);
    names are unique (the address, or the DNS name, by default)."""
    nodes: list[NodeConfig] = []
    for i, raw in enumerate(raw_nodes):
        r = TableReader(source, f"nodes[{i}]", raw)
        address = read_key(r, NodeConfig, "address")
        discover = read_key(r, NodeConfig, "discover")
        interval = read_key(r, NodeConfig, "discover_interval_s")
        if discover is not None:
            if address is not None:
                raise r.fail("discover", "an entry has an address or discover, not both")
            _check(r, "discover", parse_discover, discover)
            address = ""
        elif address is None:
            raise r.fail(
                "address", 'missing (HOST:PORT, "embedded", openai+http://... or discover)'
            )
        elif address != "embedded":
            _check(r, "address", check_node_address, address)
        default_name = parse_discover(discover).name.rstrip(".") if discover else address
        name = read_key(r, NodeConfig, "name", default_name)
        max_runs = read_key(r, NodeConfig, "max_runs")
        node = NodeConfig(
            name=name, address=address, discover=discover, discover_interval_s=interval,
            max_runs=max_runs,
        )  # fmt: skip
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
        if (value := read_key(r, NodeConfig, key)) is not None
    }
    server_name = read_key(r, NodeConfig, "server_name")
    tls = read_key(r, NodeConfig, "tls") or server_name is not None
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


def _discovery(r: TableReader) -> DiscoveryConfig:
    """`[discovery]`: each nameserver an IP address, with or without a port."""
    discovery = read_settings(r, DiscoveryConfig)
    for nameserver in discovery.nameservers:
        _check(r, "nameservers", parse_nameserver, nameserver)
    return discovery


def _models(source: str, raw_models: dict[str, Any]) -> dict[str, ModelConfig]:
    """`[models.NAME]`: a key left out keeps the default (`SIM_MODEL`'s for `sim-*`)."""
    models: dict[str, ModelConfig] = {}
    for name, raw in raw_models.items():
        r = TableReader(source, f"models.{name}", raw)
        base = SIM_MODEL if name.startswith("sim-") else DEFAULT_MODEL
        checks = {"tool_call_formats": _formats, "media_url_schemes": _media_schemes}
        models[name] = read_settings(r, ModelConfig, base, checks)
        r.done()
    return models


def _limits(r: TableReader) -> LimitsConfig:
    limits = read_settings(r, LimitsConfig)
    if limits.lease_renew_s * 2 > limits.lease_s:
        raise r.fail("lease_renew_s", "must be at most half of lease_s (a renewal may be late)")
    _redis_url(r, "redis_url", limits.redis_url)
    return limits


def _responses(r: TableReader) -> ResponsesConfig:
    responses = read_settings(r, ResponsesConfig)
    if responses.max_response_bytes > responses.max_bytes:
        raise r.fail("max_response_bytes", "must be at most max_bytes")
    if responses.key_max_responses > responses.max_responses:
        raise r.fail("per_key_max_responses", "must be at most max_responses")
    if responses.key_max_bytes > responses.max_bytes:
        raise r.fail("per_key_max_bytes", "must be at most max_bytes")
    if responses.path is not None and not responses.path:
        raise r.fail("path", "must not be empty")
    _redis_url(r, "redis_url", responses.redis_url)
    return responses


def _redis_url(r: TableReader, key: str, url: str | None) -> None:
    """A Redis URL, when given, is redis://, rediss:// or unix://."""
    if url is not None and urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise r.fail(key, "expected redis://HOST:PORT/DB, rediss://... or unix://...")


def _tracing(r: TableReader) -> TracingConfig:
    """`[tracing]`: each key unset defers to the OTEL_* environment (edge.observe.tracing)."""
    tracing = read_settings(r, TracingConfig)
    if tracing.endpoint is not None:
        parts = urlsplit(tracing.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise r.fail("endpoint", "expected http://HOST:PORT (an OTLP/HTTP receiver)")
    return tracing


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


def _workers(r: TableReader, key: str, value: object) -> int:
    try:
        return parse_workers(value)
    except ValueError as exc:
        raise r.fail(key, str(exc)) from None


def _stripped(r: TableReader, key: str, values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(value.strip() for value in values)


def _formats(r: TableReader, key: str, formats: tuple[str, ...]) -> tuple[str, ...]:
    """`tool_call_formats`: each one the text tool-call parser knows."""
    for fmt in formats:
        if fmt not in FORMATS:
            raise r.fail(key, f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    return formats


def _media_schemes(r: TableReader, key: str, schemes: tuple[str, ...]) -> tuple[str, ...]:
    """`media_url_schemes`, lower case; only data, http and https can be allowed."""
    schemes = tuple(s.lower().removesuffix(":") for s in schemes)
    for scheme in schemes:
        if scheme not in MEDIA_SCHEMES:
            raise r.fail(
                key, f"unsupported scheme {scheme!r} (allowed: {', '.join(MEDIA_SCHEMES)})"
            )
    return schemes


# An origin as browsers send it: scheme://host[:port], nothing after.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")


def _origins(r: TableReader, key: str, origins: tuple[str, ...]) -> tuple[str, ...]:
    """`cors_allow_origins`: each "*", or an origin (lower case, as browsers send it)."""
    for origin in origins:
        if origin != "*" and _ORIGIN.fullmatch(origin.lower()) is None:
            raise r.fail(
                key,
                f"{origin!r} is not an origin: write scheme://host[:port], no path and no"
                ' trailing slash (e.g. "https://app.example.com"), or "*"',
            )
    return tuple(origin.lower() for origin in origins)


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
