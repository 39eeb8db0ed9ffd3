"""The body of a streaming answer: `SSEBody`, the writer of its SSE frames.

Batches of the request's answer (`edge.fleet.answer.Answer`) are encoded by
the API's streamer, ready ones in one write; its end ends the answer's run,
counts the request and gives its key's stream back, before the last byte.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType

import trio
from quart.wrappers.response import ResponseBody

from edge.api.surfaces import Streamer
from edge.fleet.answer import Answer
from edge.fleet.turns import Turns
from edge.limits.limiter import Gate
from edge.stream.output import OutEvent

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class SSEBody(ResponseBody):
    """The body of a streaming answer: its SSE frames, ready ones in one write.

    The writer. Its end ends the answer's run and counts the request
    (`settled`); the request's answer ends it too, for a body quart never
    began (the client left while the head went out).
    """

    def __init__(
        self,
        answer: Answer,
        encoder: Streamer,
        turns: Turns,
        *,
        observe_gap: Callable[[float], None],
        observe_added: Callable[[float], None],
        first: list[OutEvent] | None = None,
        keepalive: bool = False,
        gate: Gate | None = None,
        on_end: Callable[[], Awaitable[None]] | None = None,
        settled: Callable[[], None] | None = None,
    ) -> None:
        self._answer = answer
        self._gate = gate
        # Called once the run ended: the request counted before the body's end.
        self._settled = settled
        # Called once the run ended, before the body's end (a stored response's save).
        self._on_end = on_end
        # What the handler took up to the commit point, written first.
        self._first = first
        self._keepalive = keepalive
        self._encoder = encoder
        self._turns = turns
        self._observe_gap = observe_gap
        self._observe_added = observe_added
        self._last_write: float | None = None

    async def __aenter__(self) -> SSEBody:
        return self

    def __aiter__(self) -> SSEBody:
        return self

    async def __anext__(self) -> bytes:
        answer = self._answer
        if self._first is not None:
            first, self._first = self._first, None
            data = self._encoder.encode(first) if first else b""
            if self._keepalive:
                data += self._encoder.keepalive
            if data:
                self._last_write = trio.current_time()
                return data
        while True:
            batch = await answer.next_batch()
            if batch == "keepalive":
                return self._encoder.keepalive
            if not batch:
                # Nothing to write: a filter held the text back, or (the session
                # terminated) everything was taken.
                if answer.session.terminated:
                    raise StopAsyncIteration
                continue
            data = self._encoder.encode(batch)
            now = trio.current_time()
            leg = answer.leg
            assert leg is not None
            event_at = leg.reader.batch_event_at
            if event_at is not None:  # the edge's share of a node event's trip
                self._observe_added(now - event_at)
            if self._last_write is not None:
                self._observe_gap(now - self._last_write)
            self._last_write = now
            return data

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Ended here, the outcome is counted before quart sends the last byte.
        try:
            await self._turns.turn()  # if cancelled meanwhile, end at once all the same
        finally:
            try:
                try:
                    await self._answer.end()
                finally:
                    if self._settled is not None:
                        self._settled()
                if self._gate is not None:
                    await self._gate.end(self._answer.outcome)
            finally:
                if self._on_end is not None:
                    await self._on_end()
