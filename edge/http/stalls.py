"""Bounds on HTTP/2 streams a client opens and never reads, per connection and in all.

HTTP/2 streams whose answer cannot be written: which they are, how many, for how long.

Owns the watch over the body sends of HTTP/2 requests (an ASGI wrapper between
hypercorn and the app, one per connection) and the one deadline-driven task that
counts the stalled ones; and `DataWritten`, which reads the headers of the frames
the server writes, and `Unwritten`, the answer bytes one connection may hold
unwritten. Knows nothing of sockets: what to do with a connection past a limit
is the connection's (`Stalls` calls `Watched.calm_down`).

A client that leaves a stream's flow-control window closed (never a WINDOW_UPDATE,
or SETTINGS_INITIAL_WINDOW_SIZE 0) keeps its answer from being written while the
socket itself stays busy, so no write deadline ever fires: the request's handler
waits in its send, its run fills its event buffer, and the bytes sit in hypercorn's
stream buffer (about 0.7 MiB a stream for a large answer). A hundred such streams per
connection, over a few connections, cost the edge hundreds of MiB, for as long as the
client likes.

hypercorn 0.18 takes each body send into its stream buffer whatever the window (the
buffer's sender, finding the window closed, reopens it to the writer at once), so the
bound is the edge's: the body bytes handed to hypercorn and not yet written in DATA
frames (`DataWritten` reads the frame headers the server writes) are bounded per
connection, and a send past the bound waits. Each body send of an HTTP/2 request is
watched: one still waiting `stall_s` after it began makes its stream stalled (a normal
client's send waits a scheduler pass or a round trip for a WINDOW_UPDATE). More than
`per_connection` stalled streams on one connection, or than `total` in the whole
server, and the connection that has the newest is closed with GOAWAY
(ENHANCE_YOUR_CALM); so is one whose stream stays stalled `limit_s` (the HTTP/1.1
rule for a client that reads nothing, `slow_client_s`).
Closing the connection ends every request on it, and each run is cancelled on its
node; their memory goes with them.

A send the app gave up on (the end of an answer, after its own deadline) leaves its
bytes in the stream buffer: its stream stays stalled until the client reads, resets
the stream, or the connection ends. Work is constant per send, and the sweep is
linear in the sends whose deadline passed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Protocol

import trio
from hypercorn.typing import (
    AppWrapper,
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
    Scope,
)
from prometheus_client import Gauge


class Watched(Protocol):
    """A connection as the watch sees it."""

    @property
    def open(self) -> bool: ...

    def calm_down(self, why: str) -> None:
        """Close the connection with GOAWAY (ENHANCE_YOUR_CALM) saying `why` (once)."""

    async def handed(self, nbytes: int) -> None:
        """`nbytes` of an answer's body were handed to the protocol; returns once the
        connection's body bytes not yet written are under its bound again."""


_DATA = 0x0
_FRAME_HEADER = 9
# Answer bytes an HTTP/2 connection may hold unwritten (its client's windows closed);
# past it, the answers' sends wait (and so count as stalled).
H2_MAX_UNWRITTEN = 2**20


class DataWritten:
    """Follows the HTTP/2 frames the server writes, by their headers: the bytes of DATA
    payloads among them (what of the answers' bodies reached the socket)."""

    __slots__ = ("_header", "_left")

    def __init__(self) -> None:
        self._header = bytearray()
        self._left = 0  # payload bytes of the current frame still to pass

    def feed(self, data: bytes | memoryview) -> int:
        """DATA payload bytes in `data` (frames may be split anywhere)."""
        written = 0
        pos, end = 0, len(data)
        while pos < end:
            if self._left:
                take = min(self._left, end - pos)
                pos += take
                self._left -= take
                continue
            take = min(_FRAME_HEADER - len(self._header), end - pos)
            self._header += data[pos : pos + take]
            pos += take
            if len(self._header) < _FRAME_HEADER:
                break
            length = int.from_bytes(self._header[:3], "big")
            if self._header[3] == _DATA:
                written += length
            self._header.clear()
            self._left = length
        return written


class Unwritten:
    """One HTTP/2 connection's answer bytes handed to hypercorn and not written yet
    (`DataWritten` reads what is written): a send that takes them past `limit` waits
    until enough is written, or the connection ends (`end`)."""

    __slots__ = ("_data", "_ended", "_held", "_limit", "_written")

    def __init__(self, limit: int = H2_MAX_UNWRITTEN) -> None:
        self._limit = limit
        self._held = 0
        self._data = DataWritten()
        self._written: trio.Event | None = None  # set for the sends waiting, if any
        self._ended = False

    async def handed(self, nbytes: int) -> None:
        """`nbytes` of an answer went to hypercorn: returns once the bytes held are
        within the limit again (or the connection is over)."""
        self._held += nbytes
        while self._held > self._limit and not self._ended:
            if self._written is None:
                self._written = trio.Event()
            await self._written.wait()

    def wrote(self, data: bytes | memoryview) -> None:
        """The connection wrote `data` (HTTP/2 frames, from its first byte on)."""
        written = self._data.feed(data)
        if written:
            self._held -= written
            if self._written is not None and self._held <= self._limit:
                self._written.set()
                self._written = None

    def end(self) -> None:
        """The connection is over: no send waits for its bytes any more."""
        self._ended = True
        if self._written is not None:
            self._written.set()


class _Send:
    """One body send of one stream: when it began, whether it is over or stalled."""

    __slots__ = ("began", "done", "owner", "stalled")

    def __init__(self, owner: StallCount, began: float) -> None:
        self.owner = owner
        self.began = began
        self.done = False
        self.stalled = False


class StallCount:
    """One connection's stalled streams (a stream counts once, by its oldest send)."""

    __slots__ = ("connection", "stalled")

    def __init__(self, connection: Watched) -> None:
        self.connection = connection
        self.stalled = 0


class Stalls:
    """Every HTTP/2 body send in progress in one server, and the stalled ones counted."""

    def __init__(
        self,
        *,
        stall_s: float,
        per_connection: int,
        total: int,
        limit_s: float,
        gauge: Gauge,
    ) -> None:
        self.stall_s = stall_s
        self.per_connection = per_connection
        self.total = total
        self.limit_s = limit_s
        self._gauge = gauge
        self.stalled = 0
        # Sends by when they began (so by deadline, every delay being the same):
        # those not stalled yet, and the stalled ones, until `limit_s`.
        self._young: deque[_Send] = deque()
        self._old: deque[_Send] = deque()
        self._wake: trio.CancelScope | None = None

    def watch(self, app: AppWrapper, connection: Watched) -> tuple[AppWrapper, StallCount]:
        """`app` with the body sends of its HTTP/2 requests watched, for `connection`."""
        count = StallCount(connection)
        return _WatchedApp(app, self, count), count

    def forget(self, count: StallCount) -> None:
        """The connection ended: its stalled streams leave the count (their sends are
        skipped as they come up)."""
        self._add(-count.stalled)
        count.stalled = 0

    async def run(self) -> None:
        """Count each send still waiting at its deadline; close what passes a limit."""
        while True:
            with trio.CancelScope(deadline=self._next_deadline()) as scope:
                self._wake = scope
                await trio.sleep_forever()
            self._wake = None
            self._sweep(trio.current_time())

    def began(self, count: StallCount) -> _Send:
        send = _Send(count, trio.current_time())
        self._young.append(send)
        wake = self._wake
        if wake is not None and wake.deadline > send.began + self.stall_s:
            wake.deadline = send.began + self.stall_s
        return send

    def ended(self, send: _Send) -> None:
        """The send is over: its bytes were taken (or its stream closed)."""
        if send.done:
            return
        send.done = True
        if send.stalled and send.owner.connection.open:
            send.owner.stalled -= 1
            self._add(-1)

    def _next_deadline(self) -> float:
        young, old = self._young, self._old
        while young and young[0].done:
            young.popleft()
        while old and old[0].done:
            old.popleft()
        first = young[0].began + self.stall_s if young else math.inf
        if old:
            first = min(first, old[0].began + self.limit_s)
        return first

    def _sweep(self, now: float) -> None:
        young, old = self._young, self._old
        while young and young[0].began + self.stall_s <= now:
            send = young.popleft()
            owner = send.owner
            if send.done or not owner.connection.open:
                continue
            send.stalled = True
            owner.stalled += 1
            self._add(1)
            old.append(send)
            if owner.stalled > self.per_connection:
                owner.connection.calm_down(
                    f"more than {self.per_connection} HTTP/2 streams on this connection wait"
                    " for their flow-control window"
                )
            elif self.stalled > self.total:
                owner.connection.calm_down(
                    f"more than {self.total} HTTP/2 streams wait for their flow-control window"
                )
        while old and old[0].began + self.limit_s <= now:
            send = old.popleft()
            if not send.done and send.owner.connection.open:
                send.owner.connection.calm_down(
                    f"an HTTP/2 stream waited {self.limit_s:g}s for its flow-control window"
                )

    def _add(self, n: int) -> None:
        self.stalled += n
        self._gauge.set(self.stalled)


class _WatchedApp:
    """The ASGI app of one connection, its HTTP/2 requests' body sends watched."""

    __slots__ = ("_app", "_count", "_stalls")

    def __init__(self, app: AppWrapper, stalls: Stalls, count: StallCount) -> None:
        self._app = app
        self._stalls = stalls
        self._count = count

    async def __call__(
        self,
        scope: Scope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        sync_spawn: Callable[..., object],
        call_soon: Callable[..., object],
    ) -> None:
        if scope["type"] != "http" or scope.get("http_version") != "2":
            await self._app(scope, receive, send, sync_spawn, call_soon)
            return
        stalls = self._stalls
        count = self._count
        # The stream's send waiting now, if any: over once the stream closes.
        waiting: list[_Send] = []

        async def watched_send(message: ASGISendEvent) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            record = stalls.began(count)
            waiting.append(record)
            await send(message)
            # hypercorn takes a body whatever the stream's window (its buffer only
            # waits for a pass of its sender): the bound on what is unwritten is ours.
            await count.connection.handed(len(message.get("body", b"")))
            # (A send given up on raises instead: its bytes stay behind, its stream
            # stalled, until the stream closes.)
            if record in waiting:  # else the stream closed meanwhile, and ended it
                waiting.remove(record)
                stalls.ended(record)

        async def watched_receive() -> ASGIReceiveEvent:
            event = await receive()
            if event["type"] == "http.disconnect":  # the stream is closed
                for record in waiting:
                    stalls.ended(record)
                waiting.clear()
            return event

        await self._app(scope, watched_receive, watched_send, sync_spawn, call_soon)
