"""Prometheus metrics of one edge process.

Each `EdgeMetrics` owns its registry (two edges in one test process do not
collide). Label values are bounded: models are the ones nodes serve (anything
else is "unknown"), nodes are configured names, statuses and kinds are fixed
sets. Work here happens per request or per write batch, never per chunk.
Chat requests are counted in one place, `edge.http.scope.ChatScope.finish`.

Worker processes (`edge.process.supervisor`): with $PROMETHEUS_MULTIPROC_DIR set when
the process starts, prometheus-client keeps every value in a file of that
directory, and `render` (on any worker) merges the files of all of them, so
one scrape sees the whole edge: counters and histograms summed over the
workers (a dead worker's counts stay), gauges of load summed over the live
workers, and `iop_edge_node_state` labelled by `pid` (each worker has its own
node connections, so its own view of each node). The supervisor counts the
restarts of workers in the same directory (`SupervisorMetrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from edge.observe.catalog import (
    CACHE_HOLD_OUTCOMES,
    CACHE_ROUTING_OUTCOMES,
    CONNECTION_ERROR_KINDS,
    EDGE_METRICS,
    KEY_REJECTIONS,
    QUEUE_TIERS,
    RELOAD_RESULTS,
    SHED_REASONS,
    SUPERVISOR_METRICS,
    UNKNOWN_TIER,
)
from edge.observe.gcpause import GcPauses
from edge.stream.output import Outcome

__all__ = [
    "CACHE_HOLD_OUTCOMES",
    "CACHE_ROUTING_OUTCOMES",
    "CONNECTION_ERROR_KINDS",
    "CONTENT_TYPE",
    "KEY_REJECTIONS",
    "QUEUE_TIERS",
    "RELOAD_RESULTS",
    "SHED_REASONS",
    "UNKNOWN_TIER",
    "EdgeMetrics",
    "SupervisorMetrics",
]

CONTENT_TYPE = CONTENT_TYPE_LATEST


class EdgeMetrics:
    """The metrics of one edge process: one attribute per entry of `EDGE_METRICS`
    (`edge.observe.catalog`, where each one's name, help, labels and buckets are)."""

    requests: Counter
    tokens: Counter
    reasoning_chars: Counter
    ttft: Histogram
    request_duration: Histogram
    time_per_output_token: Histogram
    request_queue: Histogram
    tracing: Gauge
    inter_chunk: Histogram
    added_latency: Histogram
    gc_pause: Histogram
    deferred_steps: Counter
    active_streams: Gauge
    backlog_chars: Gauge
    backlog_cuts: Counter
    node_cancels: Counter
    node_errors: Counter
    run_refusals: Counter
    node_state: Gauge
    node_waiting_runs: Gauge
    node_active_runs: Gauge
    node_kv_cache_usage: Gauge
    node_watched: Gauge
    node_state_rpcs: Counter
    discovery_errors: Counter
    retries: Counter
    migrations: Counter
    migration_gap: Histogram
    queue_depth: Gauge
    queue_seconds: Histogram
    queue_wait: Histogram
    shed: Counter
    key_queued: Gauge
    cache_routing: Counter
    cache_predicted_tokens: Counter
    cache_holds: Counter
    cache_hold: Histogram
    request_memory: Gauge
    tool_violations: Counter
    connection_errors: Counter
    open_connections: Gauge
    h2_stalled_streams: Gauge
    connections_without_request: Counter
    key_requests: Counter
    key_tokens: Counter
    key_rejections: Counter
    key_streams: Gauge
    limits_store_errors: Counter
    responses_stored: Counter
    responses_store_errors: Counter
    log_lines_dropped: Counter
    config_reloads: Counter
    config_info: Gauge

    def __init__(self, multiproc_dir: Path | None = None) -> None:
        # Where every worker's values are (None: a single process, its own values), as
        # prometheus-client found it in $PROMETHEUS_MULTIPROC_DIR when it was imported
        # (the process layer reads the variable, once, and passes it here).
        self.multiproc_dir = multiproc_dir
        # Gauges read from functions: in a worker, written by `sync` (see `_watch`).
        self._watched: list[tuple[Gauge, Callable[[], float]]] = []
        # Gauges whose value may be unknown (None): a series of theirs is there only while
        # its value is known, set when scraped (see `_refresh_optional`).
        self._optional: list[tuple[Gauge, str, Callable[[], float | None]]] = []
        # The garbage collector's pauses, timed by a callback that takes no lock, and
        # observed here from the loop (`sync`, `render`): `gc_pauses.start()` to time them.
        self.gc_pauses = GcPauses()
        self.registry = CollectorRegistry(auto_describe=True)
        for spec in EDGE_METRICS:
            setattr(self, spec.attr, spec.build(self.registry))
        self._config_digest: str | None = None

    def config_loaded(self, digest: str, loaded_at: float) -> None:
        """This process runs the configuration of `digest` since `loaded_at` (Unix time).
        The one it ran before leaves the gauge (across workers, where a series cannot be
        removed, it shows 0)."""
        previous, self._config_digest = self._config_digest, digest
        if previous is not None and previous != digest:
            if self.multiproc_dir is None:
                self.config_info.remove(previous)
            else:
                self.config_info.labels(previous).set(0)
        self.config_info.labels(digest).set(loaded_at)

    def request(
        self, model: str, node: str, stream: bool, outcome: Outcome, api: str = "chat"
    ) -> None:
        """One request that ran (or began to), by its outcome; called once per request.
        `api`: `chat`, `responses`, `messages` or `completions` (the API it came in by)."""
        stream_label = "true" if stream else "false"
        self.requests.labels(model, node, stream_label, outcome.status, api).inc()
        if outcome.status == "success" and outcome.usage is not None and outcome.usage_sample:
            u = outcome.usage
            for kind, value in (
                ("input", u.input_tokens),
                ("output", u.output_tokens),
                ("reasoning", u.reasoning_tokens),
                ("cached_input", u.cached_input_tokens),
            ):
                if value:
                    self.tokens.labels(model, node, kind, api).inc(value)
        for violation in outcome.tool_violations:
            self.tool_violations.labels(model, violation.rule).inc()
        if outcome.reasoning_chars and outcome.usage_sample:
            self.reasoning_chars.labels(model, node).inc(outcome.reasoning_chars)

    def watch_nodes(self, nodes: Iterable[tuple[str, Callable[[], float]]]) -> None:
        """`iop_edge_node_state{node}` read from each node's state when scraped.

        Across workers a value is read when another process scrapes: `sync` writes
        them (at each scrape of this worker, and every node refresh).
        """
        for name, value in nodes:
            self._watch(self.node_state.labels(name), value)
        self.sync()

    def watch_node_load(
        self, nodes: Iterable[tuple[str, Callable[[], tuple[float, float, float | None, bool]]]]
    ) -> None:
        """The node load gauges, read when scraped (as `watch_nodes`) from each node's
        function: (waiting runs, active runs, KV cache usage, watched). A KV usage the
        node does not say (None) is no series, not 0: unknown is not an empty cache."""
        for name, values in nodes:
            self._watch(self.node_waiting_runs.labels(name), partial(_item, values, 0))
            self._watch(self.node_active_runs.labels(name), partial(_item, values, 1))
            self._watch(self.node_watched.labels(name), partial(_item, values, 3))
            self._optional.append((self.node_kv_cache_usage, name, partial(_known, values, 2)))
        self.sync()

    def unwatch_node(self, name: str) -> None:
        """A node left the configuration: its gauges are read no more, and leave the scrape
        (across workers, where a series cannot be removed, they keep their last value
        until the worker restarts)."""
        parents = (
            self.node_state, self.node_waiting_runs, self.node_active_runs,
            self.node_kv_cache_usage, self.node_watched,
        )  # fmt: skip
        children = [gauge.labels(name) for gauge in parents]
        self._watched = [(g, v) for g, v in self._watched if all(g is not c for c in children)]
        self._optional = [entry for entry in self._optional if entry[1] != name]
        if self.multiproc_dir is None:
            for gauge in parents:
                gauge.remove(name)

    def cache_routed(self, outcome: str, node: str, predicted_tokens: int) -> None:
        """A cache-aware pick: how it chose, and the cached tokens it expected."""
        self.cache_routing.labels(outcome).inc()
        if predicted_tokens:
            self.cache_predicted_tokens.labels(node).inc(predicted_tokens)

    def cache_held(self, outcome: str, seconds: float) -> None:
        """A queued request's cache hold ended (`edge.fleet.cachehold`): how, and how long
        it passed up free slots."""
        self.cache_holds.labels(outcome).inc()
        self.cache_hold.observe(seconds)

    def watch_backlog(self, chars: Callable[[], float]) -> None:
        """`iop_edge_backlog_chars` read from `chars` when scraped (as `watch_nodes`)."""
        self._watch(self.backlog_chars, chars)
        self.sync()

    def watch_request_memory(self, held: Callable[[], float]) -> None:
        """`iop_edge_request_memory_bytes` read from `held` when scraped (as
        `watch_nodes`): nothing to write as each request takes and gives back."""
        self._watch(self.request_memory, held)
        self.sync()

    def _watch(self, gauge: Gauge, value: Callable[[], float]) -> None:
        """`gauge` read from `value`: when scraped in a single process; in a worker,
        written by `sync` (another process's scrape reads the file, not the function)."""
        if self.multiproc_dir is None:
            gauge.set_function(value)
        else:
            self._watched.append((gauge, value))

    def sync(self) -> None:
        """Write the values read from functions (worker processes only, but for those
        that may be unknown: see `_refresh_optional`), and the collector's pauses."""
        self.gc_pauses.drain(self._gc_paused)
        for gauge, value in self._watched:
            gauge.set(value())
        self._refresh_optional()

    def _refresh_optional(self) -> None:
        """Set each optional series whose value is known; one that is not is removed in a
        single process (a worker cannot remove a series: it keeps the last value it had,
        and never has one until its value is first known)."""
        for gauge, name, value in self._optional:
            known = value()
            if known is not None:
                gauge.labels(name).set(known)
            elif self.multiproc_dir is None:
                gauge.remove(name)

    def _gc_paused(self, generation: int, seconds: float) -> None:
        self.gc_pause.labels(str(generation)).observe(seconds)

    def render(self) -> bytes:
        if self.multiproc_dir is None:
            self.gc_pauses.drain(self._gc_paused)
            self._refresh_optional()
            return generate_latest(self.registry)
        self.sync()
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=str(self.multiproc_dir))  # type: ignore[no-untyped-call]
        return generate_latest(merged)


def _item(values: Callable[[], tuple[float, float, float | None, bool]], i: int) -> float:
    return float(values()[i] or 0)


def _known(values: Callable[[], tuple[float, float, float | None, bool]], i: int) -> float | None:
    value = values()[i]
    return None if value is None else float(value)


class SupervisorMetrics:
    """What the supervisor of worker processes counts, into the shared directory: one
    attribute per entry of `SUPERVISOR_METRICS` (`edge.observe.catalog`)."""

    restarts: Counter
    workers: Gauge
    log_lines_dropped: Counter
    config_reloads: Counter

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        for spec in SUPERVISOR_METRICS:
            setattr(self, spec.attr, spec.build(self.registry))
