"""Drives one run's session: node events in, batches of output events out.

`RunStream` is shared by the streaming and the non-streaming handler (one
code path, two renderings). It owns the stream's deadlines (first event,
idle, total), maps the end of a run onto the session's terminal, and ends
the run through the one cancel path (`RunHandle.cancel`) when the session
ends early. It knows nothing of SSE bytes or JSON bodies.
"""

from __future__ import annotations

import math
from typing import Literal

import trio

from edge.config import TimeoutsConfig
from edge.node.client import RunHandle
from edge.stream.output import OutEvent
from edge.stream.session import StreamSession

# Node events taken per batch: output for a batch goes out in one write. A
# batch also stops past MAX_BATCH_CHARS characters of delta text, so a write
# blocked on a client that stopped reading holds no more than about that much.
MAX_BATCH = 256
MAX_BATCH_CHARS = 64 * 1024


class RunStream:
    """One run, as batches of output events for the caller."""

    __slots__ = (
        "_first_event_s",
        "_got_first",
        "_idle_s",
        "_keepalive_s",
        "_last_event_at",
        "_next_keepalive",
        "_node_done",
        "_total_deadline",
        "batch_event_at",
        "first_event_at",
        "handle",
        "session",
    )

    def __init__(
        self,
        handle: RunHandle,
        session: StreamSession,
        timeouts: TimeoutsConfig,
        *,
        started_at: float,
        keepalive_s: float = 0.0,
    ) -> None:
        self.handle = handle
        self.session = session
        self._first_event_s = timeouts.first_event_s
        self._idle_s = timeouts.idle_s
        self._total_deadline = started_at + timeouts.total_s
        self._got_first = False
        self._last_event_at = started_at
        # The node itself ended the run (a terminal event arrived).
        self._node_done = False
        self.first_event_at: float | None = None
        # When the node events of the batch just returned arrived (None: no event in it).
        self.batch_event_at: float | None = None
        self._keepalive_s = keepalive_s
        self._next_keepalive = started_at + keepalive_s if keepalive_s > 0 else math.inf

    async def next_batch(self) -> list[OutEvent] | Literal["keepalive"]:
        """Wait for the next events and return the output they produce.

        Returns [] once the session has terminated and everything was taken.
        Returns "keepalive" when the caller should send a keep-alive comment
        (only while waiting for the first event).
        """
        session = self.session
        self.batch_event_at = None
        out = session.drain()
        if out or session.terminated:
            return out
        receive = self.handle.events
        event = None
        if trio.current_time() < self._total_deadline:
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
            limit = self._first_event_s if not self._got_first else self._idle_s
            deadline = min(self._total_deadline, self._last_event_at + limit)
            wake = min(deadline, self._next_keepalive) if not self._got_first else deadline
            with trio.move_on_at(wake):
                try:
                    event = await receive.receive()
                except trio.EndOfChannel:
                    self._run_ended()
                    return session.drain()
            if event is None:
                if trio.current_time() < deadline:
                    self._next_keepalive = trio.current_time() + self._keepalive_s
                    return "keepalive"
                self.timeout()
                return session.drain()
        now = self._last_event_at = self.batch_event_at = trio.current_time()
        if not self._got_first:
            self._got_first = True
            self.first_event_at = now
        feed = session.feed
        done = feed(event)
        if not done:
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
                    done = True
                    break
        if done:
            self._node_done = True
        return session.drain()

    def _run_ended(self) -> None:
        """The run's events closed before the session's terminal."""
        handle = self.handle
        if handle.error is not None:
            self.session.fail_stream(handle.error.type, handle.error.message)
        elif handle.cancel_reason == "timeout":
            self.timeout()
        elif handle.cancel_reason == "slow_client":
            self.session.cancel("cancelled")
        else:
            self.session.fail_stream("run_error", "the node's run ended without a terminal event")

    def timeout(self) -> None:
        """A deadline passed: the caller (if still reading) gets a timeout error frame."""
        what = "the first token" if not self._got_first else "the next token"
        if trio.current_time() >= self._total_deadline:
            what = "the run to finish"
        self.session.cancel("timeout", f"timed out waiting for {what}")
        self.handle.cancel("timeout")

    def shutdown(self, notice: str) -> None:
        """The edge is draining past its deadline: a notice frame, then the run is cancelled."""
        self.session.cancel("cancelled", notice, notice_type="service_unavailable")
        self.handle.cancel("shutdown")

    def abandon(self) -> None:
        """The caller is gone (or the response is done): end the run unless the node did."""
        if not self.session.terminated:
            self.session.cancel("cancelled")
        if not self._node_done:
            self.handle.cancel("client_disconnected")
