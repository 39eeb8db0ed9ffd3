"""One run on one node, from its node slot to its one outcome: `Run`.

A request's answer (`edge.fleet.answer.Answer`) opens runs through
`edge.fleet.runs.Runs`, one per attempt, the same way for streaming and
non-streaming answers:

    node = await runs.admission.acquire(model)        # a node, its slot taken
    run = runs.open(node, nursery, plan, session)      # plan: the request's RunPlan
    async with run:                                    # accept awaited
        while not run.session.terminated:
            batch = await run.reader.next_batch()      # output under the deadlines

A run's life is a state machine (`edge.fleet.phase`: OPENED, STARTING,
RUNNING, BROKEN, ENDING, ENDED, RETIRED), and every way it ends goes through
its table. The slot on the node (`in_flight`) is taken by the admission queue
(`edge.fleet.admission`) before the run is opened, and is the run's from then
on: whatever ends it, or fails before its start (`abandon`), gives the slot
back, once, when its phase reaches ENDED. Entering the run starts it with the
request's RunRequest, serialized once off the loop (`edge.node.wire`), this
attempt's node deadline appended: the node client's read task goes into
`nursery`, the request's own, and entering returns once the node accepted
(or raises the EdgeError that chooses the HTTP status). Its output, its
deadlines and the edge's early ends are its `reader`'s
(`edge.fleet.reader.RunReader`). Leaving the run ends it: if the node did
not, its read task is cancelled with an `EndCause` and sends the one
CancelRun (shielded, bounded); then the outcome is fixed, the slot given
back, and the node's verdict goes to the pool (`RunServices.settle`). The
request's nursery waits for the read task; then the run is retired. A run
never outlives its request. It takes what it needs of the fleet as
`RunServices`, named one by one: no back-reference to `Runs`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

import trio
from loguru import logger

from edge.config import TimeoutsConfig
from edge.errors import (
    EdgeError,
    NodeError,
    NodeFailedError,
    NodeTimeoutError,
    NodeUnavailableError,
    RequestError,
)
from edge.fleet.admission import Admission
from edge.fleet.nodestate import NodeState
from edge.fleet.phase import Machine, Phase, Step
from edge.fleet.pool import NodePool
from edge.fleet.reader import RunReader
from edge.fleet.turns import Turns
from edge.fleet.verdict import Verdict, report, verdict_of
from edge.node.wire import PreparedRunRequest
from edge.observe.logbound import clip
from edge.observe.metrics import EdgeMetrics
from edge.stream.output import Outcome
from edge.stream.session import StreamSession

# The node's deadline (`deadline_unix_ms`) is the run's plus this: the edge ends a run
# itself at its deadline (its timeout, the one the client is told), and the node's is a
# backstop for an edge that is gone. Equal, the node's `cancelled` raced the edge's own
# timer and, read first, ended the answer as a node's failure, not as its timeout.
NODE_DEADLINE_GRACE_S = 1.0


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What metrics and logs need to know of a run."""

    run_id: str
    model: str
    node: str
    stream: bool
    started_at: float
    request_id: str = ""
    api: str = "chat"  # the API the request came in by (a metrics label)


OutcomeHook = Callable[[RunInfo, Outcome], None]


@dataclass(frozen=True, slots=True)
class RunServices:
    """What a run needs of the fleet around it (`edge.fleet.runs.Runs` gives it): named
    one by one, so a run holds no back-reference to whoever opened it."""

    pool: NodePool
    admission: Admission
    metrics: EdgeMetrics
    timeouts: TimeoutsConfig
    turns: Turns | None
    # A run entered (in flight, for drain), and a run whose request is over.
    joined: Callable[[Run], None]
    left: Callable[[Run], None]

    def settle(self, run: Run, start: RunStart, outcome: Outcome) -> None:
        """`run`'s outcome is fixed: a run the node accepted leaves the stream gauge (its
        time to first event observed), its node's errors are counted, its usage and
        verdict go to the pool, its slot is given back."""
        if run.reader.handle is not None:
            self._observe(run)
        node_error = _node_error(run, outcome)
        if node_error is not None:
            self.metrics.node_errors.labels(run.info.node, node_error).inc()
        pool = self.pool
        prefix = start.payload.prefix
        if prefix is not None and outcome.usage is not None and outcome.usage_sample:
            pool.run_usage(start.node, prefix.blocks, start.predicted, outcome.usage)
        report(
            pool, start.node, run.verdict, outcome, output_seen=run.reader.output_seen,
            started_at=run.info.started_at, metrics=self.metrics,
        )  # fmt: skip
        self.admission.release(start.node)

    def _observe(self, run: Run) -> None:
        """A run the node accepted is over: the stream gauge, and its time to first event."""
        metrics = self.metrics
        metrics.active_streams.dec()
        first = run.reader.first_event_at
        if first is not None:
            info = run.info
            metrics.ttft.labels(info.model, info.node, info.api).observe(first - info.started_at)


def _node_error(run: Run, outcome: Outcome) -> str | None:
    """The kind of node failure `run` counts (`iop_edge_node_errors_total`), once: its
    start's error, a broken stream, or the node's error event; None: none."""
    if run.start_error is not None:
        return run.start_error.type
    if run.reader.handle is None or outcome.status != "error":
        return None
    if not outcome.usage_sample:
        return "stream_broken"
    return "error_event" if outcome.error_type == NodeFailedError.type else None


@dataclass(frozen=True, slots=True)
class RunStart:
    """How a run opened by `Runs.open` starts on its node."""

    services: RunServices
    node: NodeState
    # The request's RunRequest, serialized once for all its attempts.
    payload: PreparedRunRequest
    nursery: trio.Nursery
    # Sent with the Run call: the request's trace context (None: tracing is off).
    metadata: Mapping[str, str] | None = None
    # The prefix blocks the pick expected cached on the node (cache-aware routing).
    predicted: int = 0


class Run:
    """One run on one node: its phase, start, end, outcome and verdict (the module doc)."""

    __slots__ = ("_start", "info", "machine", "outcome", "reader", "session", "start_error",
                 "verdict")  # fmt: skip

    def __init__(
        self,
        info: RunInfo,
        session: StreamSession,
        start: RunStart,
        timeouts: TimeoutsConfig,
        *,
        deadline: float,
        keepalive_s: float = 0.0,
    ) -> None:
        self.info = info
        self.session = session
        self._start: RunStart | None = start
        self.machine = Machine()
        self.reader = RunReader(
            session, self.machine, started_at=info.started_at, deadline=deadline,
            first_event_s=timeouts.first_event_s, idle_s=timeouts.idle_s,
            keepalive_s=keepalive_s, turns=start.services.turns,
        )  # fmt: skip
        self.start_error: EdgeError | None = None
        self.outcome: Outcome | None = None
        # What the run says of its node, once its outcome is fixed (`edge.fleet.verdict`);
        # None: nothing (the caller left, or the request's own fault).
        self.verdict: Verdict | None = None

    @property
    def node(self) -> NodeState | None:
        """The node the run is on (None once it was retired)."""
        return self._start.node if self._start is not None else None

    @property
    def accepted(self) -> bool:
        """Whether the node accepted the run (its events are read by its `reader`)."""
        return self.reader.handle is not None

    @property
    def life(self) -> str | None:
        """The life of its node's process the run reached, as `Tried` records it: the
        instance id the node named in its accept ("": no accept, or the node does not
        say); None: no process of the node saw the run (it was unreachable before the
        RunRequest was written, and the pool has it down)."""
        error = self.start_error
        if isinstance(error, NodeUnavailableError) and not error.sent:
            return None
        handle = self.reader.handle
        return handle.instance if handle is not None else ""

    @property
    def nothing_runs(self) -> bool:
        """Its start failed and no run of it is live on the node: the node was
        unreachable, its call ended before it accepted, or the RunRequest was never
        written (grpclib can park a request on a connection that is lost until a
        deadline: vmagamedov/grpclib#216). A node that did not accept in time may still
        hold the run until its CancelRun: not this."""
        error = self.start_error
        return isinstance(error, (NodeUnavailableError, NodeFailedError)) or (
            isinstance(error, NodeError) and not error.sent
        )

    @property
    def failed_over(self) -> bool:
        """Whether another node may serve the request instead: this run ended in a node
        failure before any byte of its answer can have reached the caller (before any
        output; for a non-streaming answer, before its end)."""
        verdict = self.verdict
        return (
            verdict is not None
            and verdict.retryable
            and (not self.reader.output_seen or not self.info.stream)
        )

    @property
    def reached_node(self) -> bool:
        """Whether the node may have seen the run: it was accepted, or its start failed
        other than unreachable or refused before sending (the node may have logged it)."""
        return not isinstance(self.start_error, (NodeUnavailableError, RequestError))

    async def __aenter__(self) -> Run:
        """Start the run on its node (its slot taken already), wait for the node's accept."""
        start = self._start
        assert start is not None
        self.machine.go(Step.START)
        start.services.joined(self)
        # From here on, whatever raises fixes the outcome and gives the slot back.
        try:
            # The node's deadline, converted once from the run's deadline (and its grace).
            remaining = self.reader.deadline - trio.current_time() + NODE_DEADLINE_GRACE_S
            encoded = start.payload.attempt(int((time.time() + remaining) * 1000))
            self.reader.handle = await start.node.client.start_run(
                start.nursery, encoded, deadline=self.reader.deadline,
                slow_consumer_s=start.services.timeouts.slow_client_s,
                accept_s=start.services.timeouts.first_event_s, metadata=start.metadata,
            )  # fmt: skip
            if self.reader.delivered is not None:  # a client that stops reading: let go
                self.reader.handle.events.on_stall(self.reader.delivered.stalled)
        except EdgeError as exc:
            self.start_error = exc
            if isinstance(exc, NodeUnavailableError):
                start.services.pool.mark_down(start.node, exc.message)
            # The run id ties this to the node's own record of the run.
            logger.bind(
                request_id=self.info.request_id, run_id=self.info.run_id, node=self.info.node,
                error_type=exc.type,
            ).warning("run {} did not start on node {}: {}", self.info.run_id, self.info.node,
                      clip(exc.message))  # fmt: skip
            status: Literal["error", "timeout"] = (
                "timeout" if isinstance(exc, NodeTimeoutError) else "error"
            )
            self._fix(Step.START_FAILED, Outcome(status, error_type=exc.type, usage_sample=False))
            raise
        except BaseException as exc:
            # The caller left (or the edge is stopping) before the node accepted;
            # start_run has cancelled the run and sent its CancelRun.
            self.abandon(exc)
            raise
        self.machine.go(Step.ACCEPT)
        start.services.metrics.active_streams.inc()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.end()

    def abandon(self, exc: BaseException) -> None:
        """`exc` came before the node accepted the run (or before it was entered): its
        outcome is fixed and its slot given back. A no-op once the node accepted (the
        run ends when left) or its outcome is fixed."""
        status: Literal["error", "cancelled"] = (
            "error" if isinstance(exc, Exception) else "cancelled"
        )
        self._fix(Step.ABANDON, Outcome(status, usage_sample=False))

    async def end(self) -> None:
        """End the run unless the node did, give the slot back, fix the outcome.

        Idempotent: the streaming body calls it when its iteration ends (so the
        outcome is counted before the answer's last byte), the request's answer
        again when the request's cycle ends (a body quart never began). A run
        the node ended waits for its read task to close the node's stream (a
        few loop passes): cut by the end of the request's cycle instead, the
        close would cost a stream reset. A run the edge ends does not wait:
        its read task sends the CancelRun, shielded, in the request's nursery,
        which waits for it.
        """
        if not self.machine.go(Step.END):
            return
        reader = self.reader
        reader.close()
        handle = reader.handle
        assert handle is not None
        try:
            if handle.cause is None and handle.error is None:  # the node ended it
                await handle.done.wait()
        finally:  # counted even if the wait is cut (the client left meanwhile)
            if self.session.settings.trace:
                logger.bind(**self.session.log_fields()).info("stream closed")
            outcome = self.session.outcome
            assert outcome is not None
            self._fix(Step.SETTLE, outcome)

    def hand_over(self) -> None:
        """The run broke after output (`reader.broke`) and another run continues its
        answer: this one ends with the outcome of its break (its verdict, its slot back);
        the session, now the other run's, is left as it is. The caller waited for the
        read task: the node ended the run, or was told to."""
        brk = self.reader.broke
        assert brk is not None
        if not self.machine.may(Step.HAND_OVER):
            return
        reasoning_chars = int(self.session.log_fields()["reasoning_len"])
        self._fix(Step.HAND_OVER, brk.outcome(reasoning_chars))

    def end_break(self) -> None:
        """The answer does not move: the session gets its break's terminal (an error
        frame), as without migration, and the run goes on to its end."""
        brk = self.reader.broke
        if brk is not None:
            self.reader.broke = None
            self.machine.go(Step.KEEP)  # (a no-op for a run handed over already)
            brk.end(self.session)

    def _fix(self, step: Step, outcome: Outcome) -> None:
        """Take `step` to ENDED: the outcome fixed, the verdict told, the slot given back.
        Nothing when the step is a no-op in the run's phase."""
        if not self.machine.go(step):
            return
        assert self.machine.phase is Phase.ENDED
        self.outcome = outcome
        handle = self.reader.handle
        self.verdict = verdict_of(
            outcome, self.start_error, handle.cause if handle is not None else None,
            accepted=handle is not None,
        )  # fmt: skip
        if self._start is not None:
            self._start.services.settle(self, self._start, outcome)

    def retire(self) -> None:
        """The run's request is over, its read task too: the run is no longer in flight.

        Its start (which holds the request's nursery) is let go: kept, it would tie
        the run, the request's scope and its tasks into a cycle only the garbage
        collector frees."""
        if not self.machine.go(Step.RETIRE):
            return
        if self._start is not None:
            self._start.services.left(self)
            self._start = None
        # The answer so far holds its request's way to move (its RunRequest): a cycle.
        self.reader.delivered = None
        # A start's error keeps its type and message: its traceback's frames hold this
        # run and the request's bytes, a cycle only a full garbage collection frees.
        if self.start_error is not None:
            self.start_error.__traceback__ = None
