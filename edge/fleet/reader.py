"""A run's output under its deadlines: `RunReader`, the events side of a `Run`.

`next_batch` feeds the node's events to the session (a delta longer than the
session's slice, a slice a batch, a scheduler pass between them) and owns
every deadline of the run on one clock, trio's: first event, idle, total,
keep-alive; the slow reader's limit is the event buffer's. The ways the edge
ends a run early are here too, each with its cause for the one CancelRun
(`close`: the caller is done or gone; `shut_down`: the drain's deadline;
`timeout`), and so is the break of an answer that may move: an error or a
broken stream after output is held in `broke` (the run's phase goes to
BROKEN) instead of fed, for the answer to continue elsewhere or end as the
break would.
"""

from __future__ import annotations

import math
from typing import Literal

import trio

from edge.errors import NodeFailedError, NodeTimeoutError, OverloadedError, ShuttingDownError
from edge.fleet.continuation import Break, Delivered, failed_break, stream_break
from edge.fleet.phase import Machine, Step
from edge.fleet.turns import Turns
from edge.node.bridge import EventBuffer
from edge.node.client import EndCause, RunHandle
from edge.stream.events import Complete, Delta, Failed, NodeEvent
from edge.stream.output import OutEvent
from edge.stream.session import StreamSession

# Node events taken per batch: output for a batch goes out in one write. A
# batch also stops past MAX_BATCH_CHARS characters of delta text, so a write
# blocked on a client that stopped reading holds no more than about that much.
MAX_BATCH = 256
MAX_BATCH_CHARS = 64 * 1024
# The end of a stream whose client read nothing while its output waited (the run was
# cancelled on its node), for a client that reads again.
SLOW_CLIENT_NOTICE = "the stream was ended: its client read nothing while its output waited"
SLOW_CLIENT_CUT = (
    "the stream was ended: its client read nothing while the edge held too much unread"
    " output for clients that stopped reading"
)


class RunReader:
    """The output of one run under its deadlines (see the module doc)."""

    __slots__ = (
        "_first_event_s",
        "_idle_s",
        "_keepalive_s",
        "_last_event_at",
        "_machine",
        "_next_keepalive",
        "_turns",
        "batch_event_at",
        "broke",
        "deadline",
        "delivered",
        "first_event_at",
        "handle",
        "head_sent",
        "output_seen",
        "session",
    )

    def __init__(
        self,
        session: StreamSession,
        machine: Machine,
        *,
        started_at: float,
        deadline: float,
        first_event_s: float,
        idle_s: float,
        keepalive_s: float = 0.0,
        turns: Turns | None = None,
    ) -> None:
        self.session = session
        self._machine = machine
        # The run's one total deadline (trio clock): its request's, across attempts.
        self.deadline = deadline
        self._first_event_s = first_event_s
        self._idle_s = idle_s
        self._last_event_at = started_at
        self._keepalive_s = keepalive_s
        self._next_keepalive = started_at + keepalive_s if keepalive_s > 0 else math.inf
        # Feeding the session a batch is a heavy step: it takes a turn (`edge.fleet.turns`).
        self._turns = turns
        self.handle: RunHandle | None = None  # set once the node accepted the run
        self.first_event_at: float | None = None
        # When the node events of the batch just returned arrived (None: no event in it).
        self.batch_event_at: float | None = None
        # Whether output beyond the role chunk was taken (the answer's commit point).
        self.output_seen = False
        # Whether the answer's head went out before its output: its commit point was a
        # keep-alive, so a break from here is not failover's restart.
        self.head_sent = False
        # The answer so far, when it may move to another node if this run breaks after
        # output (`edge.fleet.migration`): the events fed are kept there, and a break
        # after output is not fed but kept in `broke`, the session left open.
        self.delivered: Delivered | None = None
        self.broke: Break | None = None

    async def next_batch(self) -> list[OutEvent] | Literal["keepalive"]:
        """Wait for the next events and return the output they produce.

        Returns [] once the session has terminated and everything was taken (or a
        break is held). Returns "keepalive" when the caller should send a keep-alive
        comment (only while waiting for the first event).
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
        handle = self.handle
        assert handle is not None
        receive = handle.events
        event = await self._next_event(receive)
        if event is None:
            return session.drain()
        if isinstance(event, str):
            return "keepalive"
        now = trio.current_time()
        if self._turns is not None:
            await self._turns.turn()
        self._last_event_at = self.batch_event_at = now
        if self.first_event_at is None:
            self.first_event_at = now
        self._feed_batch(receive, event)
        return session.drain()

    async def _next_event(self, receive: EventBuffer) -> NodeEvent | Literal["keepalive"] | None:
        """The next node event under the deadlines; "keepalive" when one is due; None
        when the run's events ended (closed, or a deadline passed: said to the session)."""
        if trio.current_time() < self.deadline:
            # An event already buffered came while the edge was busy elsewhere (its
            # writer blocked on a slow reader, or a loaded loop): the node was not
            # silent, so it is taken whatever the first-event/idle clock says.
            try:
                return receive.receive_nowait()
            except trio.WouldBlock:
                pass
            except trio.EndOfChannel:
                self._closed()
                return None
        waiting_first = self.first_event_at is None
        limit = self._first_event_s if waiting_first else self._idle_s
        deadline = min(self.deadline, self._last_event_at + limit)
        wake = min(deadline, self._next_keepalive) if waiting_first else deadline
        with trio.move_on_at(wake):
            try:
                return await receive.receive()
            except trio.EndOfChannel:
                self._closed()
                return None
        now = trio.current_time()
        if now < deadline:
            self._next_keepalive = now + self._keepalive_s
            return "keepalive"
        self.timeout()
        return None

    def _feed_batch(self, receive: EventBuffer, event: NodeEvent) -> None:
        """Feed `event`, and everything else already here, to the session: one batch."""
        feed = self.session.feed if self.delivered is None else self._tap
        if feed(event):
            return
        # The buffer's character count only falls while this loop runs (the node's
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

    def _tap(self, event: NodeEvent) -> bool:
        """`session.feed`, the answer so far kept in `delivered`; a break after output (the
        node's error or cancelled event) is kept in `broke` instead of fed."""
        delivered = self.delivered
        assert delivered is not None
        kind = type(event)
        if kind is Delta:  # the most common event first
            delivered.delta(event.text)  # type: ignore[union-attr]
            return self.session.feed(event)
        if kind is Failed:
            assert isinstance(event, Failed)
            reason = failed_break(event)
            if reason is not None and delivered.output:
                delivered.broke(event)
                self._hold(Break(reason, event))
                return True
        elif kind is Complete:
            assert isinstance(event, Complete)
            event = delivered.summed(event)
        else:
            delivered.add(event)
        return self.session.feed(event)

    def _hold(self, brk: Break) -> None:
        self.broke = brk
        self._machine.go(Step.BREAK)

    def _closed(self) -> None:
        """The run's events closed before the session's terminal: say why, from the cause.
        A run whose answer may move, whose stream broke after output or after its head
        went out (no cause: the edge did not end it), holds its break instead."""
        handle = self.handle
        assert handle is not None
        delivered = self.delivered
        movable = delivered is not None and (delivered.output or self.head_sent)
        if handle.cause is None and movable:
            assert delivered is not None
            delivered.broke(None)
            self._hold(stream_break(handle.error))
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
