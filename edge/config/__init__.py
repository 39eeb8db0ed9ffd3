"""The configuration: typed settings from TOML, and one clear line per mistake.

The modules, bottom up: `toml` (`ConfigError`, the table reader, reading a file),
`address` (listen and node addresses) and `files` (the files a configuration names,
read once) import nothing of the rest; `spec` (what makes a settings field a key of the
file, with its default, meaning and bounds, and reading keys by it), `routing` (the
settings of the nodes and of how runs reach them) and `schema` (the others, and
`Config`), each key said once there; `keys` (`[[keys]]`, `api_keys_file`), `parse` (a
document into a `Config`), `reload` (what a new `Config` changes in a running edge,
what waits for a restart) and `reference` (docs/config-reference.md, generated from the
settings and `parse`).

A node's command (`edge.nodes.sim.cli`, `edge.nodes.upstream.cli`) imports `toml` and
`address` directly and must not load the schema, and through it `edge.api` and
`edge.stream`. So this file imports nothing when it runs: each name below is looked up
in its module on first use (`from edge.config import Config` loads the schema then).

May import `api` (the forwarding policy's limits), `observe` (`TracingConfig`), `stream`
(tool-call formats, sentinels), `errors`; never `node`, `fleet`, `limits`, `nodes`,
`http` or `process`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.config.address import check_node_address, split_address, upstream_url
    from edge.config.keys import hmac_equal
    from edge.config.parse import (
        LoadedConfig,
        config_digest,
        load_config,
        load_config_file,
        parse_config,
        parse_workers,
    )
    from edge.config.routing import (
        ADMISSION_POLICIES,
        ROUTING_POLICIES,
        SERVICE_TIERS,
        AdmissionConfig,
        DiscoveryConfig,
        NodeConfig,
        RoutingConfig,
    )
    from edge.config.schema import (
        DEFAULT_MODEL,
        MAX_WORKERS,
        REASONING_PARSERS,
        RESPONSE_STORES,
        SIM_MODEL,
        Config,
        KeyConfig,
        LimitsConfig,
        LogConfig,
        ModelConfig,
        ResponsesConfig,
        ServerConfig,
        TimeoutsConfig,
    )
    from edge.config.toml import ConfigError, TableReader, read_toml

__all__ = [
    "ADMISSION_POLICIES",
    "DEFAULT_MODEL",
    "MAX_WORKERS",
    "REASONING_PARSERS",
    "RESPONSE_STORES",
    "ROUTING_POLICIES",
    "SERVICE_TIERS",
    "SIM_MODEL",
    "AdmissionConfig",
    "Config",
    "ConfigError",
    "DiscoveryConfig",
    "KeyConfig",
    "LimitsConfig",
    "LoadedConfig",
    "LogConfig",
    "ModelConfig",
    "NodeConfig",
    "ResponsesConfig",
    "RoutingConfig",
    "ServerConfig",
    "TableReader",
    "TimeoutsConfig",
    "check_node_address",
    "config_digest",
    "hmac_equal",
    "load_config",
    "load_config_file",
    "parse_config",
    "parse_workers",
    "read_toml",
    "split_address",
    "upstream_url",
]

# Where the names of __all__ are defined, searched in this order (the cheap ones first).
_MODULES = ("toml", "address", "routing", "schema", "keys", "parse")


def __getattr__(name: str) -> object:
    """A name of `__all__`, from the first module defining it; kept here once found."""
    if name in __all__:
        for module in _MODULES:
            found = import_module(f"{__name__}.{module}").__dict__.get(name)
            if found is not None:
                globals()[name] = found
                return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
