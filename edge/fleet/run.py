"""One run on one node, from its node slot to its one outcome: `Run`.

A chat request becomes runs here (`edge.fleet.runs.Runs` opens them), the
same way for streaming and non-streaming answers (`edge.fleet.failover`
tries again on another node when one cannot start):

    node = await runs.admission.acquire(model)        # a node, its slot taken
    run = runs.open(node, nursery, plan, session)      # plan: the request's RunPlan
    async with run:                                    # accept awaited
        while not run.session.terminated:
            batch = await run.next_batch()             # output under the deadlines

The slot on the node (`in_flight`) is taken by the admission queue
(`edge.fleet.admission`) before the run is opened, and is the run's from then
on: whatever ends it, or fails before its start (`abandon`), gives the slot
back. Entering the run starts it with the request's RunRequest, serialized
once off the loop (`edge.node.wire`), this attempt's node deadline appended:
the node client's read task goes into `nursery`, the request's own scope,
and entering returns once the node accepted (or raises the EdgeError that
chooses the HTTP status). `next_batch` feeds node events to the session (a
delta longer than the session's slice, a slice a batch, a scheduler pass
between them) and owns every deadline on one clock, trio's: first event,
idle, total (also the read task's deadline and, converted once, the node's
`deadline_unix_ms`, NODE_DEADLINE_GRACE_S later), keep-alive; the slow reader's limit is the event
buffer's. Leaving the run ends it: if the node did not, its read task is
cancelled with an `EndCause` and sends the one CancelRun (shielded,
bounded); the slot is given back (to the next queued request), the node's
verdict goes to the pool (`run_succeeded` / `run_failed`; `run_refused` for
a run the node refused or was too busy for), and the outcome
is fixed, once (`outcome`), and handed to whoever counts it (`on_end`). The
scope's nursery waits for the read task; then the run is retired. A run
never outlives its request's scope. It takes what it needs of the fleet as
`RunServices`, named one by one: no back-reference to `Runs`.
"""

from __future__ import annotations

import math
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
    OverloadedError,
    RequestError,
    ShuttingDownError,
)
from edge.fleet.admission import Admission
from edge.fleet.continuation import Break, Delivered, failed_break, stream_break
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.fleet.turns import Turns
from edge.fleet.verdict import Verdict, report, verdict_of
from edge.node.client import EndCause, RunHandle
from edge.node.wire import PreparedRunRequest
from edge.observe.logbound import clip
from edge.observe.metrics import EdgeMetrics
from edge.stream.events import Complete, Failed, NodeEvent
from edge.stream.output import Outcome, OutEvent
from edge.stream.session import StreamSession

# Node events taken per batch: output for a batch goes out in one write. A
# batch also stops past MAX_BATCH_CHARS characters of delta text, so a write
# blocked on a client that stopped reading holds no more than about that much.
MAX_BATCH = 256
MAX_BATCH_CHARS = 64 * 1024
# The node's deadline (`deadline_unix_ms`) is the run's plus this: the edge ends a run
# itself at its deadline (its timeout, the one the client is told), and the node's is a
# backstop for an edge that is gone. Equal, the node's `cancelled` raced the edge's own
# timer and, read first, ended the answer as a node's failure, not as its timeout.
NODE_DEADLINE_GRACE_S = 1.0
# The end of a stream whose client read nothing while its output waited (the run was
# cancelled on its node), for a client that reads again.
SLOW_CLIENT_NOTICE = "the stream was ended: its client read nothing while its output waited"
SLOW_CLIENT_CUT = (
    "the stream was ended: its client read nothing while the edge held too much unread"
    " output for clients that stopped reading"
)


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
    # A run entered (in flight, for drain), and a run whose request is over.
    joined: Callable[[Run], None]
    left: Callable[[Run], None]


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
    """One run on one node: slot, accept, events, deadlines, end cause, outcome."""

    __slots__ = (
        "_exited",
        "_first_event_s",
        "_idle_s",
        "_keepalive_s",
        "_last_event_at",
        "_next_keepalive",
        "_start",
        "_turns",
        "batch_event_at",
        "broke",
        "deadline",
        "delivered",
        "first_event_at",
        "handle",
        "head_sent",
        "info",
        "on_end",
        "outcome",
        "output_seen",
        "session",
        "start_error",
        "verdict",
    )

    @property
    def node(self) -> NodeState | None:
        """The node the run is on (None once it was retired)."""
        return self._start.node if self._start is not None else None

    @property
    def accepted(self) -> bool:
        """Whether the node accepted the run (its events are read from `handle`)."""
        return self.handle is not None

    @property
    def life(self) -> str | None:
        """The life of its node's process the run reached, as `Tried` records it: the
        instance id the node named in its accept ("": no accept, or the node does not
        say); None: no process of the node saw the run (it was unreachable before the
        RunRequest was written, and the pool has it down)."""
        error = self.start_error
        if isinstance(error, NodeUnavailableError) and not error.sent:
            return None
        return self.handle.instance if self.handle is not None else ""

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
            and (not self.output_seen or not self.info.stream)
        )

    @property
    def reached_node(self) -> bool:
        """Whether the node may have seen the run: it was accepted, or its start failed
        other than unreachable or refused before sending (the node may have logged it)."""
        return not isinstance(self.start_error, (NodeUnavailableError, RequestError))

    def __init__(
        self,
        info: RunInfo,
        session: StreamSession,
        timeouts: TimeoutsConfig,
        *,
        keepalive_s: float = 0.0,
        start: RunStart | None = None,
        deadline: float | None = None,
        on_end: Callable[[], None] | None = None,
        turns: Turns | None = None,
    ) -> None:
        self.info = info
        # Feeding the session a batch is a heavy step: it takes a turn (`edge.fleet.turns`).
        self._turns = turns
        self.session = session
        self._start = start
        started_at = info.started_at
        # The run's one total deadline (trio clock): its request's, across attempts.
        self.deadline = started_at + timeouts.total_s if deadline is None else deadline
        # Called once the outcome is fixed (the request's count); settable until then.
        self.on_end = on_end
        self._first_event_s = timeouts.first_event_s
        self._idle_s = timeouts.idle_s
        self._last_event_at = started_at
        self._keepalive_s = keepalive_s
        self._next_keepalive = started_at + keepalive_s if keepalive_s > 0 else math.inf
        self.handle: RunHandle | None = None  # set once the node accepted the run
        self._exited = False
        self.start_error: EdgeError | None = None
        self.outcome: Outcome | None = None
        self.first_event_at: float | None = None
        # When the node events of the batch just returned arrived (None: no event in it).
        self.batch_event_at: float | None = None
        # Whether output beyond the role chunk was taken (see `MovableRun.first_batch`).
        self.output_seen = False
        # Whether the answer's head went out before its output: its commit point was a
        # keep-alive (`MovableRun.first_batch`), so a break from here is not failover's restart.
        self.head_sent = False
        # The answer so far, when it may move to another node if this run breaks after
        # output (`edge.fleet.migration`): the events fed are kept there, and a break
        # after output is not fed but kept in `broke`, the session left open, for the
        # caller to continue elsewhere (`hand_over`) or end as the break would (`end_break`).
        self.delivered: Delivered | None = None
        self.broke: Break | None = None
        # What the run says of its node, once its outcome is fixed: a failure reason
        # (`edge.fleet.verdict`: a start failure, "error_event", "stream_broken",
        # "timeout"), "ok", a refusal of the node's, or None (nothing: the caller left, or the edge
        # refused the request).
        self.verdict: Verdict | None = None

    # --- the run's life -------------------------------------------------------------

    async def __aenter__(self) -> Run:
        """Start the run on its node (its slot taken already), wait for the node's accept."""
        start = self._start
        assert start is not None, "a run from Runs.open"
        node = start.node
        start.services.joined(self)
        # From here on, whatever raises fixes the outcome and gives the slot back.
        try:
            # The node's deadline, converted once from the run's deadline (and its grace).
            remaining = self.deadline - trio.current_time() + NODE_DEADLINE_GRACE_S
            deadline_unix_ms = int((time.time() + remaining) * 1000)
            encoded = start.payload.attempt(deadline_unix_ms)
            self.handle = await node.client.start_run(
                start.nursery,
                encoded,
                deadline=self.deadline,
                slow_consumer_s=start.services.timeouts.slow_client_s,
                accept_s=self._first_event_s,
                metadata=start.metadata,
            )
        except EdgeError as exc:
            self.start_error = exc
            if isinstance(exc, NodeUnavailableError):
                start.services.pool.mark_down(node, exc.message)
            start.services.metrics.node_errors.labels(self.info.node, exc.type).inc()
            # The run id ties this to the node's own record of the run.
            logger.bind(
                request_id=self.info.request_id, run_id=self.info.run_id, node=self.info.node,
                error_type=exc.type,
            ).warning("run {} did not start on node {}: {}", self.info.run_id, self.info.node,
                      clip(exc.message))  # fmt: skip
            status: Literal["error", "timeout", "cancelled"] = (
                "timeout" if isinstance(exc, NodeTimeoutError) else "error"
            )
            self._end(Outcome(status, error_type=exc.type, usage_sample=False))
            raise
        except BaseException as exc:
            # The caller left (or the edge is stopping) before the node accepted;
            # start_run has cancelled the run and sent its CancelRun.
            self.abandon(exc)
            raise
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
        outcome is fixed and its slot given back. Nothing for a run the node accepted
        (it ends when left) or whose outcome is fixed already; idempotent."""
        if self.handle is None:
            status: Literal["error", "cancelled"] = (
                "error" if isinstance(exc, Exception) else "cancelled"
            )
            self._end(Outcome(status, usage_sample=False))

    async def end(self) -> None:
        """End the run unless the node did, give the slot back, fix the outcome.

        Idempotent: the streaming body calls it when its iteration ends (so the
        outcome is counted before the answer's last byte), the request's scope
        again when the request's cycle ends (a body quart never began). A run
        the node ended waits for its read task to close the node's stream (a
        few loop passes): cut by the end of the request's cycle instead, the
        close would cost a stream reset. A run the edge ends does not wait:
        its read task sends the CancelRun, shielded, in the request's nursery,
        which waits for it.
        """
        if self._exited or self.handle is None:
            return
        self._exited = True
        self.close()
        handle = self.handle
        try:
            if handle.cause is None and handle.error is None:  # the node ended it
                await handle.done.wait()
        finally:  # counted even if the wait is cut (the client left meanwhile)
            self._settle(self.session.outcome)

    def hand_over(self) -> None:
        """The run broke after output (`broke`) and another run continues its answer:
        this one ends with the outcome of its break (its verdict, its slot back); the
        session, now the other run's, is left as it is. The caller waited for the read
        task (`handle.done`): the node ended the run, or was told to."""
        brk, handle = self.broke, self.handle
        assert brk is not None
        assert handle is not None
        if self._exited:
            return
        self._exited = True
        reasoning_chars = int(self.session.log_fields()["reasoning_len"])
        self._settle(brk.outcome(reasoning_chars))

    def end_break(self) -> None:
        """The answer does not move: the session gets its break's terminal (an error
        frame), as without migration, and the run goes on to its end."""
        brk = self.broke
        if brk is not None:
            self.broke = None
            brk.end(self.session)

    def _settle(self, outcome: Outcome | None) -> None:
        """The run's metrics, and its outcome fixed (the slot given back)."""
        session = self.session
        assert outcome is not None
        start = self._start
        if start is not None:
            metrics = start.services.metrics
            metrics.active_streams.dec()
            if self.first_event_at is not None:
                metrics.ttft.labels(self.info.model, self.info.node, self.info.api).observe(
                    self.first_event_at - self.info.started_at
                )
            if outcome.status == "error" and not outcome.usage_sample:
                metrics.node_errors.labels(self.info.node, "stream_broken").inc()
        if session.settings.trace:
            logger.bind(**session.log_fields()).info("stream closed")
        self._end(outcome)

    def close(self) -> None:
        """The caller is gone, or its answer is done: end the run unless the node did."""
        if not self.session.terminated:
            self.session.cancel("cancelled")
        # Unless the node's terminal reached the edge (read or not): a session the
        # edge failed first (an answer past its cap) ends the node's run too.
        handle = self.handle
        if handle is not None and not handle.events.terminal:
            handle.cancel(EndCause.CLIENT_GONE)

    def shut_down(self, notice: str) -> None:
        """The drain deadline passed: a notice frame for the caller, then the run ends."""
        self.session.cancel("cancelled", notice, notice_type=ShuttingDownError.type)
        if self.handle is not None:
            self.handle.cancel(EndCause.SHUTDOWN)

    def _end(self, outcome: Outcome) -> None:
        """Fix the outcome (once), give the node slot back, tell the pool how the node did."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.verdict = verdict_of(
            outcome, self.start_error, self.handle.cause if self.handle is not None else None,
            accepted=self.handle is not None,
        )  # fmt: skip
        start = self._start
        if start is not None:
            pool = start.services.pool
            prefix = start.payload.prefix
            if prefix is not None and outcome.usage is not None and outcome.usage_sample:
                pool.run_usage(start.node, prefix.blocks, start.predicted, outcome.usage)
            report(
                pool, start.node, self.verdict, outcome, output_seen=self.output_seen,
                started_at=self.info.started_at, metrics=start.services.metrics,
            )  # fmt: skip
            start.services.admission.release(start.node)
        if self.on_end is not None:
            self.on_end()

    def retire(self) -> None:
        """The run's request is over, its read task too: the run is no longer in flight.

        Its start (which holds the request's nursery) is let go: kept, it would tie
        the run, the request's scope and its tasks into a cycle only the garbage
        collector frees."""
        if self._start is not None:
            self._start.services.left(self)
            self._start = None
        # The answer so far holds its request's way to move (scope, RunRequest): a cycle.
        self.delivered = None
        # A start's error keeps its type and message: its traceback's frames hold this
        # run and the request's bytes, a cycle only a full garbage collection frees.
        if self.start_error is not None:
            self.start_error.__traceback__ = None

    # --- events under the deadlines ---------------------------------------------------

    async def next_batch(self) -> list[OutEvent] | Literal["keepalive"]:
        """Wait for the next events and return the output they produce.

        Returns [] once the session has terminated and everything was taken.
        Returns "keepalive" when the caller should send a keep-alive comment
        (only while waiting for the first event).
        """
        session = self.session
        self.batch_event_at = None
        out = session.drain()
        if out or session.terminated or self.broke is not None:
            return out
        if session.resuming:
            # The rest of a long delta, a slice a batch, after a pass of the scheduler:
            # what a node sends in one event never holds the loop in one step.
            if self._turns is not None:
                await self._turns.turn()
            await trio.lowlevel.checkpoint()
            session.resume()
            return session.drain()
        assert self.handle is not None
        receive = self.handle.events
        event = None
        now = trio.current_time()
        if now < self.deadline:
            # An event already buffered came while the edge was busy elsewhere (its
            # writer blocked on a slow reader, or a loaded loop): the node was not
            # silent, so it is taken whatever the first-event/idle clock says.
            try:
                event = receive.receive_nowait()
            except trio.WouldBlock:
                pass
            except trio.EndOfChannel:
                self._run_ended()
                return session.drain()
        if event is None:
            waiting_first = self.first_event_at is None
            limit = self._first_event_s if waiting_first else self._idle_s
            deadline = min(self.deadline, self._last_event_at + limit)
            wake = min(deadline, self._next_keepalive) if waiting_first else deadline
            with trio.move_on_at(wake):
                try:
                    event = await receive.receive()
                except trio.EndOfChannel:
                    self._run_ended()
                    return session.drain()
            now = trio.current_time()
            if event is None:
                if now < deadline:
                    self._next_keepalive = now + self._keepalive_s
                    return "keepalive"
                self.timeout()
                return session.drain()
        if self._turns is not None:
            await self._turns.turn()
        self._last_event_at = self.batch_event_at = now
        if self.first_event_at is None:
            self.first_event_at = now
        feed = session.feed if self.delivered is None else self._tap
        if not feed(event):
            # Everything else already here goes out in the same batch. The
            # buffer's character count only falls while this loop runs (the node's
            # read loop cannot run in between), so the drop is what was taken.
            receive_nowait = receive.receive_nowait
            floor = receive.held_chars - MAX_BATCH_CHARS
            for _ in range(MAX_BATCH):
                if receive.held_chars <= floor:
                    break
                try:
                    event = receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                if feed(event):
                    break
        return session.drain()

    def _tap(self, event: NodeEvent) -> bool:
        """`session.feed`, the answer so far kept in `delivered`; a break after output (the
        node's error or cancelled event) is kept in `broke` instead of fed."""
        delivered = self.delivered
        assert delivered is not None
        kind = type(event)
        if kind is Failed:
            assert isinstance(event, Failed)
            reason = failed_break(event)
            if reason is not None and delivered.output:
                delivered.broke(event)
                self.broke = Break(reason, event)
                return True
        elif kind is Complete:
            assert isinstance(event, Complete)
            event = delivered.summed(event)
        else:
            delivered.add(event)
        return self.session.feed(event)

    def _run_ended(self) -> None:
        """The run's events closed before the session's terminal: say why, from the cause.
        A run whose answer may move, whose stream broke after output or after its head
        went out (no cause: the edge did not end it), keeps its break in `broke` instead."""
        handle = self.handle
        assert handle is not None
        delivered = self.delivered
        movable = delivered is not None and (delivered.output or self.head_sent)
        if handle.cause is None and movable:
            assert delivered is not None
            delivered.broke(None)
            self.broke = stream_break(handle.error)
            return
        if handle.error is not None:
            self.session.fail_stream(handle.error.type, handle.error.message)
        elif handle.cause is EndCause.TIMEOUT:
            self.timeout()
        elif handle.cause is EndCause.SLOW_CLIENT:  # said to a client that reads again
            if handle.events.cut_by_backlog:
                notice, kind = SLOW_CLIENT_CUT, OverloadedError.type
            else:
                notice, kind = SLOW_CLIENT_NOTICE, NodeTimeoutError.type
            self.session.cancel("cancelled", notice, notice_type=kind)
        elif handle.cause is not None:
            self.session.cancel("cancelled")
        else:
            self.session.fail_stream(
                NodeFailedError.type, "the node's run ended without a terminal event"
            )

    def timeout(self) -> None:
        """A deadline passed: the caller (if still reading) gets a timeout error frame."""
        what = "the first token" if self.first_event_at is None else "the next token"
        if trio.current_time() >= self.deadline:
            what = "the run to finish"
        self.session.cancel("timeout", f"timed out waiting for {what}")
        if self.handle is not None:
            self.handle.cancel(EndCause.TIMEOUT)
