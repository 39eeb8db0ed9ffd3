"""Prometheus metrics of one edge process.

Each `EdgeMetrics` owns its registry (two edges in one test process do not
collide). Label values are bounded: models are the ones nodes serve (anything
else is "unknown"), nodes are configured names, statuses and kinds are fixed
sets. Work here happens per request or per write batch, never per chunk.
Chat requests are counted in one place, `edge.http.scope.ChatScope.finish`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

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
    "over_limit",  # accepted past max_connections: answered 503 and closed
    "accept_fd_exhausted",  # accept() failed: EMFILE, ENFILE, ENOBUFS, ENOMEM
    "accept_error",  # accept() failed otherwise
)
_FAST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1)


class EdgeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "iop_edge_requests", "Chat completion requests by how they ended.",
            ["model", "node", "stream", "status"], registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "iop_edge_tokens", "Tokens reported by nodes for successful runs.",
            ["model", "node", "type"], registry=r,
        )  # fmt: skip
        self.reasoning_chars = Counter(
            "iop_edge_reasoning_chars", "Characters of reasoning produced.",
            ["model", "node"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "iop_edge_time_to_first_token_seconds",
            "From dispatch to the node's first event.",
            ["model", "node"], buckets=_LATENCY_BUCKETS, registry=r,
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
        self.active_streams = Gauge("iop_edge_active_streams", "Runs in flight.", registry=r)
        self.node_cancels = Counter(
            "iop_edge_node_cancels", "CancelRun RPCs sent to nodes.", ["node"], registry=r
        )
        self.node_errors = Counter(
            "iop_edge_node_errors",
            "Node failures by kind: node_unavailable, run_error, timeout (starting a run),"
            " stream_broken, error_event (mid-run).",
            ["node", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "iop_edge_retries",
            "Runs tried again on another node, by the node that failed and why.",
            ["node", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "iop_edge_queue_depth", "Requests waiting for a free node slot.", registry=r
        )
        self.queue_seconds = Histogram(
            "iop_edge_queue_seconds", "Time a request waited for a free node slot.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.shed = Counter(
            "iop_edge_shed",
            "Requests answered 503 overloaded, by reason: queue_full, queue_timeout.",
            ["reason"],
            registry=r,
        )

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
            "iop_edge_open_connections", "HTTP connections being served.", registry=r
        )
        self.connections_without_request = Counter(
            "iop_edge_connections_without_request",
            "Client connections that ended before any request on them reached the app "
            "(a TCP probe, a client that left or reset before its request was read).",
            registry=r,
        )

    def request(self, model: str, node: str, stream: bool, outcome: Outcome) -> None:
        """One chat request that ran (or began to), by its outcome; called once per request."""
        self.requests.labels(model, node, "true" if stream else "false", outcome.status).inc()
        if outcome.status == "error" and outcome.error_type == "run_error" and outcome.usage_sample:
            # The node reported the failure itself (an `error` event); a broken
            # stream (no usage sample) is counted as "stream_broken" by the caller.
            self.node_errors.labels(node, "error_event").inc()
        if outcome.status == "success" and outcome.usage is not None and outcome.usage_sample:
            u = outcome.usage
            for kind, value in (
                ("input", u.input_tokens),
                ("output", u.output_tokens),
                ("reasoning", u.reasoning_tokens),
                ("cached_input", u.cached_input_tokens),
            ):
                if value:
                    self.tokens.labels(model, node, kind).inc(value)
        for violation in outcome.tool_violations:
            self.tool_violations.labels(model, violation.rule).inc()
        if outcome.reasoning_chars and outcome.usage_sample:
            self.reasoning_chars.labels(model, node).inc(outcome.reasoning_chars)

    def render(self) -> bytes:
        return generate_latest(self.registry)
