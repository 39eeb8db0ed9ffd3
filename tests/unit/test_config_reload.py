"""What a reload changes in a running edge and what waits for a restart
(edge.config.reload): pure functions of two `Config`s."""

from __future__ import annotations

from dataclasses import fields, replace

from edge.config import (
    AdmissionConfig,
    Config,
    KeyConfig,
    LimitsConfig,
    LogConfig,
    ModelConfig,
    NodeConfig,
    RoutingConfig,
    ServerConfig,
    TimeoutsConfig,
)
from edge.config.reload import RESTART_ONLY, applied, changes, restart_needed
from edge.observe.tracing import TracingConfig

RUNNING = Config(
    server=ServerConfig(listen="127.0.0.1:8080", api_keys=("old",), workers=2),
    keys=(KeyConfig("a", "secret-a", rpm=5), KeyConfig("b", "secret-b")),
    nodes=(NodeConfig("n1", "127.0.0.1:1"), NodeConfig("n2", "127.0.0.1:2")),
    models={"m": ModelConfig()},
    source="edge.toml",
)


def test_restart_only_names_real_settings() -> None:
    """Every setting RESTART_ONLY names is a field of its table (a typo would keep
    nothing)."""
    for table, keys in RESTART_ONLY.items():
        names = {f.name for f in fields(getattr(Config(), table))}
        assert keys is None or set(keys) <= names, table


def test_settings_bound_at_start_are_named_and_keep_their_running_values() -> None:
    """A new listen address, worker count, log format, limits store and tracing endpoint
    are named as needing a restart and keep their running values in what is applied;
    the live settings of the same file apply."""
    new = replace(
        RUNNING,
        server=replace(RUNNING.server, listen="0.0.0.0:9000", workers=4, keepalive_s=3.0),
        log=LogConfig(level="DEBUG", format="json"),
        timeouts=replace(TimeoutsConfig(), total_s=10.0, slow_client_s=1.0),
        limits=LimitsConfig(redis_url="redis://r:6379/0", fail_open=False),
        tracing=TracingConfig(endpoint="http://otel:4318", sample_ratio=0.5),
        routing=RoutingConfig(policy="cache_aware", retries=0),
        admission=AdmissionConfig(max_queue=7),
    )
    assert restart_needed(RUNNING, new) == [
        "server.listen", "server.workers", "log.format", "timeouts.slow_client_s",
        "limits.redis_url", "limits.fail_open", "tracing.endpoint",
    ]  # fmt: skip
    live = applied(RUNNING, new)
    assert live.server.listen == "127.0.0.1:8080"
    assert live.server.workers == 2
    assert live.log == LogConfig(level="DEBUG", format="text")
    assert live.limits == RUNNING.limits
    assert live.tracing == TracingConfig(sample_ratio=0.5)
    assert live.timeouts == replace(TimeoutsConfig(), total_s=10.0)
    assert live.server.keepalive_s == 3.0
    assert live.routing == new.routing
    assert live.admission == new.admission
    assert restart_needed(RUNNING, live) == []


def test_the_same_file_changes_nothing() -> None:
    """A reload of what runs: nothing to restart, nothing changed."""
    assert restart_needed(RUNNING, RUNNING) == []
    assert changes(RUNNING, applied(RUNNING, RUNNING)) == []


def test_changes_name_settings_and_entries() -> None:
    """Settings by `table.key`; keys, nodes and models by name, added (+), removed (-) or
    changed (~: a key's secret or limits, a node's address or max_runs); the API keys of
    [server] counted, never shown."""
    new = replace(
        RUNNING,
        server=replace(RUNNING.server, api_keys=("new", "other"), keepalive_s=1.0),
        routing=RoutingConfig(breaker_failures=2),
        keys=(KeyConfig("a", "secret-a", rpm=6), KeyConfig("c", "secret-c")),
        nodes=(NodeConfig("n1", "127.0.0.1:1", max_runs=3), NodeConfig("n3", "127.0.0.1:3")),
        models={"m": ModelConfig(strict=True), "m2": ModelConfig()},
    )
    assert changes(RUNNING, new) == [
        "server.keepalive_s",
        "routing.breaker_failures",
        "server.api_keys (2 keys)",
        "keys +c -b ~a",
        "nodes +n3 -n2 ~n1",
        "models +m2 ~m",
    ]
    assert all("secret" not in part and "new" not in part for part in changes(RUNNING, new))
