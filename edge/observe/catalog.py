"""The edge's Prometheus metrics, as data: each one's name, help, labels and buckets.

`EdgeMetrics` and `SupervisorMetrics` (`edge.observe.metrics`) build their
attributes from `EDGE_METRICS` and `SUPERVISOR_METRICS`, in this order (the
order of /metrics). A name here is what dashboards and docs/ read: change one
only with them. This module counts nothing and holds no registry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from edge.stream.toolcall import VIOLATION_RULES

Metric = Counter | Gauge | Histogram
# How the values of worker processes merge into one gauge (prometheus-client's
# `multiprocess_mode`): "livesum" sums the live workers, "liveall" labels each by `pid`.
MergeMode = Literal["all", "liveall", "livesum", "livemax"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric, and the attribute of its owner that holds it."""

    kind: type[Counter] | type[Gauge] | type[Histogram]
    attr: str
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms only
    merge: MergeMode = "all"  # gauges only
    # Series shown (at 0) from the start, before any is counted: a value of its one
    # label, or a value of each of its labels.
    preset: tuple[str | tuple[str, ...], ...] = ()

    def build(self, registry: CollectorRegistry) -> Metric:
        """The metric, registered in `registry`."""
        metric: Metric
        if self.kind is Histogram:
            metric = Histogram(
                self.name, self.help, self.labels, registry=registry, buckets=self.buckets
            )
        elif self.kind is Gauge:
            metric = Gauge(
                self.name, self.help, self.labels, registry=registry, multiprocess_mode=self.merge
            )
        else:
            metric = Counter(self.name, self.help, self.labels, registry=registry)
        for value in self.preset:
            metric.labels(*value) if isinstance(value, tuple) else metric.labels(value)
        return metric


_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip
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
# A collection's pause: a young one takes about a millisecond, a full one grows with the heap.
_GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_FAST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1)

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
# The service tiers of the admission queue's bands (edge.config.SERVICE_TIERS), and the
# label of a request shed before its tier was known.
QUEUE_TIERS = ("priority", "default", "flex")
UNKNOWN_TIER = "unknown"
# Why a request was shed without a run (admission control): 503 overloaded, 429 for flex.
SHED_REASONS = (
    "queue_full",  # no free node slot and the queue holds [admission] max_queue already
    "key_full",  # its tenant has [admission] max_queue_per_key waiting already
    "queue_timeout",  # waited [admission] queue_timeout_s for a slot
    "memory_budget",  # its parsed form would pass [admission] memory_budget_bytes
)
# The shed series shown from the start: each reason by each tier it may come with.
_SHED_SERIES = (
    *((reason, tier) for reason in ("queue_full", "key_full", "queue_timeout")
      for tier in QUEUE_TIERS),
    ("queue_full", UNKNOWN_TIER),
    ("memory_budget", UNKNOWN_TIER),
)  # fmt: skip
# How the cache-aware policy chose a node (edge.fleet.cacheaware).
CACHE_ROUTING_OUTCOMES = ("hit", "miss", "load_bound", "session", "short")
# How a queued request's cache hold ended (edge.fleet.cachehold): a slot handed to it
# while it held, its bound passed first, it left the queue first.
CACHE_HOLD_OUTCOMES = ("served", "expired", "left")
# Why a key's request was refused: over rpm, over tpm, at max_streams, a model outside its
# allow-list (answered 404), the limits store down with fail_open = false (503).
KEY_REJECTIONS = ("requests", "tokens", "streams", "model", "store")
# Why a look-up of a discover entry's DNS name failed (edge.process.resolver): no answer
# in time, every server failed (SERVFAIL, REFUSED) or could not be reached, the name does
# not exist, it has no address, anything else.
DISCOVERY_ERRORS = ("timeout", "servfail", "nxdomain", "empty", "error")
# How a reload of the configuration ended (edge.process.reload): applied, or refused (a
# file with a mistake, or one that changed since the supervisor checked it).
RELOAD_RESULTS = ("ok", "error")

# Lines the log's writer dropped (edge.observe.logwriter): counted by workers and supervisor alike.
_LOG_LINES_DROPPED = MetricSpec(
    Counter, "log_lines_dropped", "iop_edge_log_lines_dropped",
    "Log lines dropped because the reader of the log (stderr) was too slow: the queue in"
    " front of it ([log] queue_bytes) was full.",
)  # fmt: skip
_CONFIG_RELOADS = MetricSpec(
    Counter, "config_reloads", "iop_edge_config_reloads",
    "Reloads of the configuration file (SIGHUP), by result: ok (applied; what waits for a"
    " restart is logged), error (refused: the configuration in use stays). With worker"
    " processes each worker counts the reloads it applies, the supervisor the files it"
    " refuses.",
    ("result",),
)  # fmt: skip

# Requests and runs. Chat requests are counted in one place, `edge.http.scope.ChatScope.finish`.
_RUNS = (
    MetricSpec(
        Counter, "requests", "iop_edge_requests",
        "Requests that start runs (chat completions, responses, messages, completions) by"
        " how they ended.",
        ("model", "node", "stream", "status", "api"),
    ),
    MetricSpec(
        Counter, "tokens", "iop_edge_tokens", "Tokens reported by nodes for successful runs.",
        ("model", "node", "type", "api"),
    ),
    MetricSpec(
        Counter, "reasoning_chars", "iop_edge_reasoning_chars",
        "Characters of reasoning produced.", ("model", "node"),
    ),
    MetricSpec(
        Histogram, "ttft", "iop_edge_time_to_first_token_seconds",
        "From dispatch to the node's first event.",
        ("model", "node", "api"), buckets=_LATENCY_BUCKETS,
    ),
    # What users chart per model, node and API, observed once per request that ran
    # (`edge.http.scope.ChatScope.finish`).
    MetricSpec(
        Histogram, "request_duration", "iop_edge_request_duration_seconds",
        "From a request's arrival to its answer's outcome, for requests that ran.",
        ("model", "node", "api"), buckets=_DURATION_BUCKETS,
    ),
    MetricSpec(
        Histogram, "time_per_output_token", "iop_edge_time_per_output_token_seconds",
        "Successful runs: from the first event to the last, per output token after the"
        " first (the node's output token count).",
        ("model", "node", "api"), buckets=_TOKEN_BUCKETS,
    ),
    MetricSpec(
        Histogram, "request_queue", "iop_edge_request_queue_seconds",
        "Time each request that ran waited for its node slot (0: a slot was free).",
        ("model", "node", "api"), buckets=_QUEUE_BUCKETS,
    ),
    MetricSpec(
        Gauge, "tracing", "iop_edge_tracing",
        "1 when this edge exports OpenTelemetry trace spans, 0 when tracing is off.",
        merge="livemax",
    ),
    MetricSpec(
        Histogram, "inter_chunk", "iop_edge_inter_chunk_seconds",
        "Between two writes of one stream.", ("model", "node"), buckets=_LATENCY_BUCKETS,
    ),
    MetricSpec(
        Histogram, "added_latency", "iop_edge_added_latency_seconds",
        "From a node event's arrival to its bytes handed to the HTTP server.",
        buckets=_FAST_BUCKETS,
    ),
    MetricSpec(
        Histogram, "gc_pause", "iop_edge_gc_pause_seconds",
        "The event loop's pauses for Python's garbage collector, by generation (0-2): a"
        " pause holds every stream of the process.",
        ("generation",), buckets=_GC_BUCKETS,
    ),
    MetricSpec(
        Counter, "deferred_steps", "iop_edge_deferred_steps",
        "Heavy steps of requests that waited for a later scheduler pass: the edge's"
        " CPU was saturated (edge.fleet.turns).",
    ),
    MetricSpec(
        Gauge, "active_streams", "iop_edge_active_streams", "Runs in flight.", merge="livesum"
    ),
    # The output held for streams, against [timeouts] slow_client_backlog_chars
    # (edge.node.backlog); read when scraped (`EdgeMetrics.watch_backlog`).
    MetricSpec(
        Gauge, "backlog_chars", "iop_edge_backlog_chars",
        "Characters of output the runs' event buffers hold for their streams (and 768 Ki for"
        " each stream whose client stopped reading), against [timeouts] slow_client_backlog_chars.",
        merge="livesum",
    ),
    MetricSpec(
        Counter, "backlog_cuts", "iop_edge_backlog_cuts",
        "Runs ended as slow clients because the output held for streams passed"
        " [timeouts] slow_client_backlog_chars (the longest waiting first).",
    ),
    MetricSpec(
        Counter, "node_cancels", "iop_edge_node_cancels",
        "Runs the edge cancelled on nodes: CancelRun RPCs sent, and the upstream requests"
        " of openai+http nodes closed.",
        ("node",),
    ),
    MetricSpec(
        Counter, "node_errors", "iop_edge_node_errors",
        "Node failures by kind: node_unavailable, run_error, timeout (starting a run),"
        " stream_broken, error_event (mid-run).",
        ("node", "kind"),
    ),
    MetricSpec(
        Counter, "run_refusals", "iop_edge_run_refusals",
        "Runs a node refused, by the HTTP status it gave: 4xx but 408 and 429, the"
        " request's fault (answered with that status, not retried); 429, the node"
        " overloaded (tried on another node). Neither is a node error nor counts on"
        " its circuit breaker.",
        ("node", "status"),
    ),
)  # fmt: skip

# Fleet health and admission. The pool sets node_state (its values:
# edge.fleet.health.STATE_VALUES); the run side and the admission queue the rest.
_FLEET = (
    MetricSpec(
        Gauge, "node_state", "iop_edge_node_state",
        "Each node's state: 0 down (unreachable), 1 up, 2 half_open (circuit breaker lets"
        " one probe run through), 3 open (circuit breaker: no new runs).",
        ("node",), merge="liveall",
    ),
    # What each node reports of itself on its Watch stream (edge.fleet.load), read from
    # the pool when scraped (`EdgeMetrics.watch_node_load`); 0 while it reports none.
    MetricSpec(
        Gauge, "node_waiting_runs", "iop_edge_node_waiting_runs",
        "Runs waiting for a place on each node (its queue, every edge's runs), as its"
        " last Watch report said.",
        ("node",), merge="livemax",
    ),
    MetricSpec(
        Gauge, "node_active_runs", "iop_edge_node_active_runs",
        "Runs in flight on each node (every edge's), as its last Watch report said.",
        ("node",), merge="livemax",
    ),
    MetricSpec(
        Gauge, "node_kv_cache_usage", "iop_edge_node_kv_cache_usage",
        "The part of each node's KV cache in use (0 to 1), as its last Watch report said.",
        ("node",), merge="livemax",
    ),
    MetricSpec(
        Gauge, "node_watched", "iop_edge_node_watched",
        "1 when a node's state comes from its Watch stream, 0 when it is asked with"
        " Describe (a node older than Watch).",
        ("node",), merge="liveall",
    ),
    MetricSpec(
        Counter, "node_state_rpcs", "iop_edge_node_state_rpcs",
        "Describe and Watch RPCs sent to each node, by rpc: describe, watch (a"
        " subscription).",
        ("node", "rpc"),
    ),
    MetricSpec(
        Counter, "discovery_errors", "iop_edge_discovery_errors",
        "Failed look-ups of the DNS name of a [[nodes]] entry with discover, by entry (its"
        " name) and reason: " + ", ".join(DISCOVERY_ERRORS) + ". Its last answer's nodes"
        " stay.",
        ("entry", "reason"),
    ),
    MetricSpec(
        Counter, "retries", "iop_edge_retries",
        "Runs retried on another node before the first byte, by the node that failed"
        " and why (the node error's type).",
        ("node", "reason"),
    ),
    MetricSpec(
        Counter, "migrations", "iop_edge_migrations",
        "Answers whose run broke after output (its node gone, drained or failed), by"
        " reason (stream_broken, node_gone, node_drained, error_event) and outcome:"
        " migrated (a node that can continue took the rest), else why not: exhausted,"
        " expired, too_long, stalled, no_node, failed.",
        ("reason", "outcome"),
    ),
    MetricSpec(
        Histogram, "migration_gap", "iop_edge_migration_gap_seconds",
        "From a run's break to the first event of the run that continues its answer.",
        buckets=_LATENCY_BUCKETS,
    ),
    MetricSpec(
        Gauge, "queue_depth", "iop_edge_queue_depth",
        "Requests waiting for a free node slot, by service tier.",
        ("tier",), merge="livesum", preset=QUEUE_TIERS,
    ),
    MetricSpec(
        Histogram, "queue_seconds", "iop_edge_queue_seconds",
        "Time requests waited for a free node slot (admitted and shed alike).",
        buckets=_QUEUE_BUCKETS,
    ),
    MetricSpec(
        Histogram, "queue_wait", "iop_edge_queue_wait_seconds",
        "Time requests waited for a free node slot (admitted and shed alike), by service"
        " tier.",
        ("tier",), buckets=_QUEUE_BUCKETS,
    ),
    MetricSpec(
        Counter, "shed", "iop_edge_shed",
        "Requests shed without a run (503 overloaded; 429 for flex), by reason: "
        + ", ".join(SHED_REASONS) + "; and by service tier (" + UNKNOWN_TIER
        + ": shed before its tier was known).",
        ("reason", "tier"), preset=_SHED_SERIES,
    ),
    MetricSpec(
        Gauge, "key_queued", "iop_edge_key_queued",
        "Requests waiting for a free node slot, by API key name ([[keys]] entries only).",
        ("key",), merge="livesum",
    ),
    MetricSpec(
        Counter, "cache_routing", "iop_edge_cache_routing",
        "Runs routed by the cache-aware policy, by how their node was chosen: hit (the"
        " longest cached prefix), miss (no node held its first block: rendezvous),"
        " load_bound (a node holding a longer prefix was past the load bound), session"
        " (a named session: X-Session-Id, prompt_cache_key), short (a prompt under one block).",
        ("outcome",), preset=CACHE_ROUTING_OUTCOMES,
    ),
    MetricSpec(
        Counter, "cache_predicted_tokens", "iop_edge_cache_predicted_tokens",
        "Prompt tokens the cache-aware policy expected cached on the node it chose (its"
        " index's prediction; the nodes' own count is iop_edge_tokens_total"
        ' {type="cached_input"}).',
        ("node",),
    ),
    MetricSpec(
        Counter, "cache_holds", "iop_edge_cache_holds",
        "Queued requests that passed up free node slots to wait for a busy node holding"
        " more of their prompt ([routing] cache_hold_s), by how the hold ended: served (a"
        " slot handed to it while it held), expired (its bound passed first: it took its"
        " turn), left (its client gone, its queue timeout, shed).",
        ("outcome",), preset=CACHE_HOLD_OUTCOMES,
    ),
    MetricSpec(
        Histogram, "cache_hold", "iop_edge_cache_hold_seconds",
        "How long queued requests passed up free node slots for a busy node holding more"
        " of their prompt: from the first slot passed up to the end of the hold.",
        buckets=_QUEUE_BUCKETS,
    ),
    MetricSpec(
        Gauge, "request_memory", "iop_edge_request_memory_bytes",
        "Bytes held by the requests queued and running, as their parsed form is"
        " estimated (the memory budget's count, [admission] memory_budget_bytes).",
        merge="livesum",
    ),
    MetricSpec(
        Counter, "tool_violations", "iop_edge_tool_call_violations",
        "Tool calls returned although they break the declared tools or tool_choice"
        " (tool_validation report), by rule: " + ", ".join(VIOLATION_RULES) + ".",
        ("model", "rule"),
    ),
)  # fmt: skip

# The HTTP server's connections.
_CONNECTIONS = (
    MetricSpec(
        Counter, "connection_errors", "iop_edge_connection_errors",
        "Connections closed by the server for cause, by kind: "
        + ", ".join(CONNECTION_ERROR_KINDS) + ".",
        ("kind",), preset=CONNECTION_ERROR_KINDS,
    ),
    MetricSpec(
        Gauge, "open_connections", "iop_edge_open_connections", "HTTP connections being served.",
        merge="livesum",
    ),
    MetricSpec(
        Gauge, "h2_stalled_streams", "iop_edge_h2_stalled_streams",
        "HTTP/2 streams whose answer waits for the client to open its flow-control"
        " window (a body send waiting past a moment).",
        merge="livesum",
    ),
    MetricSpec(
        Counter, "connections_without_request", "iop_edge_connections_without_request",
        "Client connections that ended before any request on them reached the app "
        "(a TCP probe, a client that left or reset before its request was read).",
    ),
)  # fmt: skip

# API keys and their limits, by key name: never the key itself; the response store of
# /v1/responses (edge.store); the configuration.
_KEYS_AND_STORES = (
    MetricSpec(
        Counter, "key_requests", "iop_edge_key_requests",
        "Chat requests admitted, by API key name.", ("key",),
    ),
    MetricSpec(
        Counter, "key_tokens", "iop_edge_key_tokens",
        "Tokens of the runs of each API key, by type: input, output.", ("key", "type"),
    ),
    MetricSpec(
        Counter, "key_rejections", "iop_edge_key_rejections",
        "Chat requests refused by their API key's limits, by limit: "
        + ", ".join(KEY_REJECTIONS) + ".",
        ("key", "limit"),
    ),
    MetricSpec(
        Gauge, "key_streams", "iop_edge_key_streams",
        "Requests in flight of each API key with max_streams (summed over workers).",
        ("key",), merge="livesum",
    ),
    MetricSpec(
        Counter, "limits_store_errors", "iop_edge_limits_store_errors",
        "Calls to the limits store (redis) that failed or missed their deadline.", ("store",),
    ),
    MetricSpec(
        Counter, "responses_stored", "iop_edge_responses_stored",
        "Responses offered to the response store, by result: stored, too_large (over "
        "max_response_bytes: answered, not kept), failed (the store failed or missed "
        "its deadline: answered, not kept).",
        ("result",),
    ),
    MetricSpec(
        Counter, "responses_store_errors", "iop_edge_responses_store_errors",
        "Calls to the response store that failed or missed their deadline, by "
        "operation: read, write, delete.",
        ("op",),
    ),
    _LOG_LINES_DROPPED,
    replace(_CONFIG_RELOADS, preset=RELOAD_RESULTS),
    MetricSpec(
        Gauge, "config_info", "iop_edge_config_info",
        "The configuration this process runs: `digest` is the first 16 hex digits of the"
        " sha256 of its file (`sha256sum config.toml`), the value the Unix time it was"
        " loaded; a digest a worker ran before shows 0.",
        ("digest",), merge="liveall",
    ),
)  # fmt: skip

# What each edge process (a worker, or the one process) counts.
EDGE_METRICS: tuple[MetricSpec, ...] = _RUNS + _FLEET + _CONNECTIONS + _KEYS_AND_STORES

# What the supervisor of worker processes counts, into the workers' shared directory.
SUPERVISOR_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        Counter, "restarts", "iop_edge_worker_restarts",
        "Worker processes that ended on their own (crashed, killed) and were started again.",
    ),
    MetricSpec(
        Gauge, "workers", "iop_edge_workers", "Worker processes running.", merge="livesum"
    ),
    _LOG_LINES_DROPPED,
    _CONFIG_RELOADS,
)  # fmt: skip
