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

from edge.stream.output import Outcome
from edge.stream.toolcall import VIOLATION_RULES

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip
# Why the HTTP server closed a connection (or refused to open one).
CONNECTION_ERROR_KINDS = (
    "exception",  # serving it raised: the connection is closed, the others go on
    "bad_request",  # a request head refused before any handler (400, 431)
    "slow_client",  # a write made no progress for slow_client_s
    "slow_request",  # a head or body arrived slower than idle_timeout_s / body_timeout_s
    "h2_reset_flood",  # HTTP/2 stream resets past the rate allowed (GOAWAY)
    "h2_stalled_streams",  # HTTP/2 streams left unread (window closed) past a limit (GOAWAY)
    "over_limit",  # accepted past max_connections: answered 503 and closed
    "accept_fd_exhausted",  # accept() failed: EMFILE, ENFILE, ENOBUFS, ENOMEM
    "accept_error",  # accept() failed otherwise
)
# Why a request was answered 503 overloaded without a run (admission control).
SHED_REASONS = (
    "queue_full",  # no free node slot and the queue holds [admission] max_queue already
    "queue_timeout",  # waited [admission] queue_timeout_s for a slot
    "memory_budget",  # its parsed form would pass [admission] memory_budget_bytes
)
# Why a key's request was refused: over rpm, over tpm, at max_streams, a model outside its
# allow-list (answered 404), the limits store down with fail_open = false (503).
# How the cache-aware policy chose a node (edge.fleet.cacheaware).
CACHE_ROUTING_OUTCOMES = ("hit", "miss", "load_bound", "session", "short")
KEY_REJECTIONS = ("requests", "tokens", "streams", "model", "store")
# Seconds a request waited for a node slot (most wait none: the first bucket).
_QUEUE_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Whole requests: from a few milliseconds to a long generation.
_DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 900,
)  # fmt: skip
# Time per output token: from a fast small model (~1 ms) to a slow large one.
_TOKEN_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5,
)  # fmt: skip
# Lines the log's writer dropped (edge.observe.logwriter): counted by workers and supervisor alike.
_LOG_LINES_DROPPED = (
    "iop_edge_log_lines_dropped",
    "Log lines dropped because the reader of the log (stderr) was too slow: the queue in"
    " front of it ([log] queue_bytes) was full.",
)
# How a reload of the configuration ended (edge.process.reload): applied, or refused (a
# file with a mistake, or one that changed since the supervisor checked it).
RELOAD_RESULTS = ("ok", "error")
_CONFIG_RELOADS = (
    "iop_edge_config_reloads",
    "Reloads of the configuration file (SIGHUP), by result: ok (applied; what waits for a"
    " restart is logged), error (refused: the configuration in use stays). With worker"
    " processes each worker counts the reloads it applies, the supervisor the files it"
    " refuses.",
)
_FAST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1)


class EdgeMetrics:
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
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "iop_edge_requests",
            "Requests that start runs (chat completions, responses, messages, completions) by"
            " how they ended.",
            ["model", "node", "stream", "status", "api"], registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "iop_edge_tokens", "Tokens reported by nodes for successful runs.",
            ["model", "node", "type", "api"], registry=r,
        )  # fmt: skip
        self.reasoning_chars = Counter(
            "iop_edge_reasoning_chars", "Characters of reasoning produced.",
            ["model", "node"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "iop_edge_time_to_first_token_seconds",
            "From dispatch to the node's first event.",
            ["model", "node", "api"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        # What users chart per model, node and API, observed once per request
        # that ran (`edge.http.scope.ChatScope.finish`).
        self.request_duration = Histogram(
            "iop_edge_request_duration_seconds",
            "From a request's arrival to its answer's outcome, for requests that ran.",
            ["model", "node", "api"], buckets=_DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.time_per_output_token = Histogram(
            "iop_edge_time_per_output_token_seconds",
            "Successful runs: from the first event to the last, per output token after the"
            " first (the node's output token count).",
            ["model", "node", "api"], buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.request_queue = Histogram(
            "iop_edge_request_queue_seconds",
            "Time each request that ran waited for its node slot (0: a slot was free).",
            ["model", "node", "api"], buckets=_QUEUE_BUCKETS, registry=r,
        )  # fmt: skip
        self.tracing = Gauge(
            "iop_edge_tracing",
            "1 when this edge exports OpenTelemetry trace spans, 0 when tracing is off.",
            registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self.inter_chunk = Histogram(
            "iop_edge_inter_chunk_seconds", "Between two writes of one stream.",
            ["model", "node"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.added_latency = Histogram(
            "iop_edge_added_latency_seconds",
            "From a node event's arrival to its bytes handed to the HTTP server.",
            buckets=_FAST_BUCKETS, registry=r,
        )  # fmt: skip
        self.deferred_steps = Counter(
            "iop_edge_deferred_steps",
            "Heavy steps of requests that waited for a later scheduler pass: the edge's"
            " CPU was saturated (edge.fleet.turns).",
            registry=r,
        )  # fmt: skip
        self.active_streams = Gauge(
            "iop_edge_active_streams", "Runs in flight.", registry=r, multiprocess_mode="livesum"
        )
        # The output held for streams, against [timeouts] slow_client_backlog_chars
        # (edge.node.backlog); read when scraped (`watch_backlog`).
        self.backlog_chars = Gauge(
            "iop_edge_backlog_chars",
            "Characters of output the runs' event buffers hold for their streams, against"
            " [timeouts] slow_client_backlog_chars.",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.backlog_cuts = Counter(
            "iop_edge_backlog_cuts",
            "Runs ended as slow clients because the output held for streams passed"
            " [timeouts] slow_client_backlog_chars (the longest waiting first).",
            registry=r,
        )  # fmt: skip
        self.node_cancels = Counter(
            "iop_edge_node_cancels",
            "Runs the edge cancelled on nodes: CancelRun RPCs sent, and the upstream requests"
            " of openai+http nodes closed.",
            ["node"],
            registry=r,
        )
        self.node_errors = Counter(
            "iop_edge_node_errors",
            "Node failures by kind: node_unavailable, run_error, timeout (starting a run),"
            " stream_broken, error_event (mid-run).",
            ["node", "kind"],
            registry=r,
        )
        self.run_refusals = Counter(
            "iop_edge_run_refusals",
            "Runs a node refused, by the HTTP status it gave: 4xx but 408 and 429, the"
            " request's fault (answered with that status, not retried); 429, the node"
            " overloaded (tried on another node). Neither is a node error nor counts on"
            " its circuit breaker.",
            ["node", "status"], registry=r,
        )  # fmt: skip

        # Fleet health and admission. The pool sets node_state (its values:
        # edge.fleet.health.STATE_VALUES); the run side and the admission queue the rest.
        self.node_state = Gauge(
            "iop_edge_node_state",
            "Each node's state: 0 down (unreachable), 1 up, 2 half_open (circuit breaker lets"
            " one probe run through), 3 open (circuit breaker: no new runs).",
            ["node"], registry=r, multiprocess_mode="liveall",
        )  # fmt: skip
        # What each node reports of itself on its Watch stream (edge.fleet.load), read from
        # the pool when scraped (`watch_node_load`); 0 while it reports none.
        self.node_waiting_runs = Gauge(
            "iop_edge_node_waiting_runs",
            "Runs waiting for a place on each node (its queue, every edge's runs), as its"
            " last Watch report said.",
            ["node"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self.node_active_runs = Gauge(
            "iop_edge_node_active_runs",
            "Runs in flight on each node (every edge's), as its last Watch report said.",
            ["node"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self.node_kv_cache_usage = Gauge(
            "iop_edge_node_kv_cache_usage",
            "The part of each node's KV cache in use (0 to 1), as its last Watch report said.",
            ["node"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self.node_watched = Gauge(
            "iop_edge_node_watched",
            "1 when a node's state comes from its Watch stream, 0 when it is asked with"
            " Describe (a node older than Watch).",
            ["node"], registry=r, multiprocess_mode="liveall",
        )  # fmt: skip
        self.node_state_rpcs = Counter(
            "iop_edge_node_state_rpcs",
            "Describe and Watch RPCs sent to each node, by rpc: describe, watch (a"
            " subscription).",
            ["node", "rpc"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "iop_edge_retries",
            "Runs retried on another node before the first byte, by the node that failed"
            " and why (the node error's type).",
            ["node", "reason"], registry=r,
        )  # fmt: skip
        self.migrations = Counter(
            "iop_edge_migrations",
            "Answers whose run broke after output (its node gone, drained or failed), by"
            " reason (stream_broken, node_gone, node_drained, error_event) and outcome:"
            " migrated (a node that can continue took the rest), else why not: exhausted,"
            " expired, too_long, no_node, failed.",
            ["reason", "outcome"], registry=r,
        )  # fmt: skip
        self.migration_gap = Histogram(
            "iop_edge_migration_gap_seconds",
            "From a run's break to the first event of the run that continues its answer.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "iop_edge_queue_depth", "Requests waiting for a free node slot.", registry=r,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.queue_seconds = Histogram(
            "iop_edge_queue_seconds",
            "Time requests waited for a free node slot (admitted and shed alike).",
            buckets=_QUEUE_BUCKETS, registry=r,
        )  # fmt: skip
        self.shed = Counter(
            "iop_edge_shed",
            "Requests answered 503 overloaded without a run, by reason: "
            + ", ".join(SHED_REASONS) + ".",
            ["reason"], registry=r,
        )  # fmt: skip
        for reason in SHED_REASONS:
            self.shed.labels(reason)
        self.cache_routing = Counter(
            "iop_edge_cache_routing",
            "Runs routed by the cache-aware policy, by how their node was chosen: hit (the"
            " longest cached prefix), miss (no node held its first block: rendezvous),"
            " load_bound (a node holding a longer prefix was past the load bound), session"
            " (a named session: X-Session-Id, prompt_cache_key), short (a prompt under one block).",
            ["outcome"], registry=r,
        )  # fmt: skip
        for outcome in CACHE_ROUTING_OUTCOMES:
            self.cache_routing.labels(outcome)
        self.cache_predicted_tokens = Counter(
            "iop_edge_cache_predicted_tokens",
            "Prompt tokens the cache-aware policy expected cached on the node it chose (its"
            " index's prediction; the nodes' own count is iop_edge_tokens_total"
            ' {type="cached_input"}).',
            ["node"], registry=r,
        )  # fmt: skip
        self.request_memory = Gauge(
            "iop_edge_request_memory_bytes",
            "Bytes held by the requests queued and running, as their parsed form is"
            " estimated (the memory budget's count, [admission] memory_budget_bytes).",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip

        self.tool_violations = Counter(
            "iop_edge_tool_call_violations",
            "Tool calls returned although they break the declared tools or tool_choice"
            " (tool_validation report), by rule: " + ", ".join(VIOLATION_RULES) + ".",
            ["model", "rule"],
            registry=r,
        )

        self.connection_errors = Counter(
            "iop_edge_connection_errors",
            "Connections closed by the server for cause, by kind: "
            + ", ".join(CONNECTION_ERROR_KINDS)
            + ".",
            ["kind"],
            registry=r,
        )
        for kind in CONNECTION_ERROR_KINDS:
            self.connection_errors.labels(kind)
        self.open_connections = Gauge(
            "iop_edge_open_connections", "HTTP connections being served.", registry=r,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.h2_stalled_streams = Gauge(
            "iop_edge_h2_stalled_streams",
            "HTTP/2 streams whose answer waits for the client to open its flow-control"
            " window (a body send waiting past a moment).",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.connections_without_request = Counter(
            "iop_edge_connections_without_request",
            "Client connections that ended before any request on them reached the app "
            "(a TCP probe, a client that left or reset before its request was read).",
            registry=r,
        )

        # API keys and their limits, by key name: never the key itself.
        self.key_requests = Counter(
            "iop_edge_key_requests", "Chat requests admitted, by API key name.",
            ["key"], registry=r,
        )  # fmt: skip
        self.key_tokens = Counter(
            "iop_edge_key_tokens", "Tokens of the runs of each API key, by type: input, output.",
            ["key", "type"], registry=r,
        )  # fmt: skip
        self.key_rejections = Counter(
            "iop_edge_key_rejections",
            "Chat requests refused by their API key's limits, by limit: "
            + ", ".join(KEY_REJECTIONS) + ".",
            ["key", "limit"], registry=r,
        )  # fmt: skip
        self.key_streams = Gauge(
            "iop_edge_key_streams",
            "Requests in flight of each API key with max_streams (summed over workers).",
            ["key"], registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.limits_store_errors = Counter(
            "iop_edge_limits_store_errors",
            "Calls to the limits store (redis) that failed or missed their deadline.",
            ["store"], registry=r,
        )  # fmt: skip
        # The response store of /v1/responses (edge.store).
        self.responses_stored = Counter(
            "iop_edge_responses_stored",
            "Responses offered to the response store, by result: stored, too_large (over "
            "max_response_bytes: answered, not kept), failed (the store failed or missed "
            "its deadline: answered, not kept).",
            ["result"], registry=r,
        )  # fmt: skip
        self.responses_store_errors = Counter(
            "iop_edge_responses_store_errors",
            "Calls to the response store that failed or missed their deadline, by "
            "operation: read, write, delete.",
            ["op"], registry=r,
        )  # fmt: skip
        self.log_lines_dropped = Counter(*_LOG_LINES_DROPPED, registry=r)
        self.config_reloads = Counter(*_CONFIG_RELOADS, ["result"], registry=r)
        for result in RELOAD_RESULTS:
            self.config_reloads.labels(result)
        self.config_info = Gauge(
            "iop_edge_config_info",
            "The configuration this process runs: `digest` is the first 16 hex digits of the"
            " sha256 of its file (`sha256sum config.toml`), the value the Unix time it was"
            " loaded; a digest a worker ran before shows 0.",
            ["digest"], registry=r, multiprocess_mode="liveall",
        )  # fmt: skip
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

    def watch_backlog(self, chars: Callable[[], float]) -> None:
        """`iop_edge_backlog_chars` read from `chars` when scraped (as `watch_nodes`)."""
        self._watch(self.backlog_chars, chars)
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
        that may be unknown: see `_refresh_optional`)."""
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

    def render(self) -> bytes:
        if self.multiproc_dir is None:
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
    """What the supervisor of worker processes counts, into the shared directory."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.restarts = Counter(
            "iop_edge_worker_restarts",
            "Worker processes that ended on their own (crashed, killed) and were started again.",
            registry=r,
        )
        self.workers = Gauge(
            "iop_edge_workers", "Worker processes running.", registry=r,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.log_lines_dropped = Counter(*_LOG_LINES_DROPPED, registry=r)
        self.config_reloads = Counter(*_CONFIG_RELOADS, ["result"], registry=r)
