"""What a run says of its node when it ends (its verdict), and who is told.

A run's verdict (`verdict_of`): a start that failed by the node's side
(START_FAILURES: unreachable, no accept in time, a failed start), its stream
broken, the node's error event, its refusal (4xx) or overload (429), the
edge's own deadline, "ok", or None (nothing of the node: the caller left, a
request too large). `report` gives it to the pool: a success closes the
breaker, a refusal or an overload counts on no breaker (and is counted by
node and status), a failure before output counts on it. RETRYABLE says which
verdicts another node may do better on (`Run.failed_over`).

Pure but for `report`'s calls into the pool and the metrics.
"""

from __future__ import annotations

from edge.errors import EdgeError, NodeFailedError, NodeTimeoutError, NodeUnavailableError
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.node.client import EndCause
from edge.observe.metrics import EdgeMetrics
from edge.stream.output import Outcome

# What a run that did not start says of its node (the pool's `run_failed` reason).
START_FAILURES: tuple[tuple[type[EdgeError], str], ...] = (
    (NodeUnavailableError, "unavailable"),
    (NodeTimeoutError, "accept_timeout"),
    (NodeFailedError, "start_failed"),
)
# The reasons a run ended before any output that another node may do better on (an
# overloaded node's 429 among them; never a refusal: every node would refuse alike).
RETRYABLE = frozenset(
    {"unavailable", "accept_timeout", "start_failed", "error_event", "stream_broken", "overloaded"}
)
# Verdicts that say nothing of the node's health (the pool's `run_refused`): the node
# refused the request (4xx: the request's fault) or was overloaded (429).
REFUSALS = frozenset({"refused", "overloaded"})


def verdict_of(
    outcome: Outcome, start_error: EdgeError | None, cause: EndCause | None, *, accepted: bool
) -> str | None:
    """What a run that ended with `outcome` says of its node: `start_error` is its
    start's failure (None: it started), `accepted` whether the node accepted it, `cause`
    why the edge ended it (None: it did not)."""
    if start_error is not None:
        for kind, reason in START_FAILURES:
            if isinstance(start_error, kind):
                return reason
        return None  # the request's own fault (too large for the node)
    if not accepted:
        return None  # the caller left before the node accepted
    if outcome.status == "error":
        if not outcome.usage_sample:
            return "stream_broken"
        if outcome.node_status:  # the node's refusal (4xx) or overload (429)
            return "overloaded" if outcome.node_status == 429 else "refused"
        # The node's error event, or a run it ended unfinished; anything else
        # (tool validation, output past the edge's cap) is the answer's, not the node's.
        return "error_event" if outcome.error_type == NodeFailedError.type else "ok"
    if outcome.status == "timeout":
        return "timeout" if cause is EndCause.TIMEOUT else None
    return "ok" if outcome.status == "success" else None


def report(
    pool: NodePool,
    node: NodeState,
    verdict: str | None,
    outcome: Outcome,
    *,
    output_seen: bool,
    started_at: float,
    metrics: EdgeMetrics,
) -> None:
    """Tell the pool how `node` did in a run whose verdict is `verdict`."""
    if verdict == "ok":
        pool.run_succeeded(node)
    elif verdict in REFUSALS:
        pool.run_refused(node)
        metrics.run_refusals.labels(node.client.name, str(outcome.node_status)).inc()
    elif verdict is not None and not output_seen:
        # A failure after output says more of the run than of the node (the node
        # served it until then), and a client can script one: the breaker counts the
        # runs a node could not answer at all.
        pool.run_failed(node, verdict, started_at=started_at)
