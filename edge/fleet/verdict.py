"""What a run says of its node when it ends (its verdict), and who is told.

A run's verdict (`verdict_of`, a `Verdict`): a start that failed by the node's
side (START_FAILURES: unreachable, no accept in time, a failed start), its stream
broken, the node's error event, its refusal (4xx) or overload (429), the
edge's own deadline, ok, or None (nothing of the node: the caller left, a
request too large). Each verdict says whether another node may do better
(`retryable`: `Run.failed_over`), whether it is a refusal, and whether it counts
on the node's breaker. `report` gives it to the pool: a success closes the
breaker, a refusal or an overload counts on no breaker (and is counted by
node and status), a failure of the node's before output counts on it.

Pure but for `report`'s calls into the pool and the metrics.
"""

from __future__ import annotations

from enum import StrEnum

from edge.errors import EdgeError, NodeFailedError, NodeTimeoutError, NodeUnavailableError
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.node.client import EndCause
from edge.observe.metrics import EdgeMetrics
from edge.stream.output import Outcome


class Verdict(StrEnum):
    """What a run says of its node (a string: the metrics' and logs' word for it)."""

    OK = "ok"
    # Its start failed by the node's side (START_FAILURES).
    UNAVAILABLE = "unavailable"
    ACCEPT_TIMEOUT = "accept_timeout"
    START_FAILED = "start_failed"
    # It broke: its stream, or the node's error event.
    STREAM_BROKEN = "stream_broken"
    ERROR_EVENT = "error_event"
    # The node refused the request (4xx: the request's fault) or was overloaded (429).
    REFUSED = "refused"
    OVERLOADED = "overloaded"
    # The edge's own deadline passed (load alone can bring it).
    TIMEOUT = "timeout"

    @property
    def retryable(self) -> bool:
        """Another node may do better, before any output: a failure of the node's, or
        its overload (never a refusal: every node would refuse alike)."""
        return self in _RETRYABLE

    @property
    def refusal(self) -> bool:
        """It says nothing of the node's health (the pool's `run_refused`)."""
        return self in (Verdict.REFUSED, Verdict.OVERLOADED)

    @property
    def counts_on_breaker(self) -> bool:
        """The node's doing: counted by its circuit breaker (a failure before output)."""
        return self in _BREAKER


_RETRYABLE = frozenset({
    Verdict.UNAVAILABLE, Verdict.ACCEPT_TIMEOUT, Verdict.START_FAILED, Verdict.ERROR_EVENT,
    Verdict.STREAM_BROKEN, Verdict.OVERLOADED,
})  # fmt: skip
_BREAKER = frozenset(
    {Verdict.ERROR_EVENT, Verdict.START_FAILED, Verdict.ACCEPT_TIMEOUT, Verdict.STREAM_BROKEN}
)
# What a run that did not start says of its node.
START_FAILURES: tuple[tuple[type[EdgeError], Verdict], ...] = (
    (NodeUnavailableError, Verdict.UNAVAILABLE),
    (NodeTimeoutError, Verdict.ACCEPT_TIMEOUT),
    (NodeFailedError, Verdict.START_FAILED),
)


def verdict_of(
    outcome: Outcome, start_error: EdgeError | None, cause: EndCause | None, *, accepted: bool
) -> Verdict | None:
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
            return Verdict.STREAM_BROKEN
        if outcome.node_status:  # the node's refusal (4xx) or overload (429)
            return Verdict.OVERLOADED if outcome.node_status == 429 else Verdict.REFUSED
        # The node's error event, or a run it ended unfinished; anything else
        # (tool validation, output past the edge's cap) is the answer's, not the node's.
        return Verdict.ERROR_EVENT if outcome.error_type == NodeFailedError.type else Verdict.OK
    if outcome.status == "timeout":
        return Verdict.TIMEOUT if cause is EndCause.TIMEOUT else None
    return Verdict.OK if outcome.status == "success" else None


def report(
    pool: NodePool,
    node: NodeState,
    verdict: Verdict | None,
    outcome: Outcome,
    *,
    output_seen: bool,
    started_at: float,
    metrics: EdgeMetrics,
) -> None:
    """Tell the pool how `node` did in a run whose verdict is `verdict`."""
    if verdict is Verdict.OK:
        pool.run_succeeded(node)
    elif verdict is not None and verdict.refusal:
        pool.run_refused(node)
        metrics.run_refusals.labels(node.client.name, str(outcome.node_status)).inc()
    elif verdict is not None and verdict.counts_on_breaker and not output_seen:
        # A failure after output says more of the run than of the node (the node
        # served it until then), and a client can script one: the breaker counts the
        # runs a node could not answer at all.
        pool.run_failed(node, verdict, started_at=started_at)
