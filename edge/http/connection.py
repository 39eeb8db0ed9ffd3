"""Serve one connection: its bytes to hypercorn's protocol and back, within time limits.

Owns what happens on a connection once it has sent something: the read loop
(the head checks of `edge.http.headcheck`, HTTP/2 bytes a piece at a time, a
turn per new request, shedding), the write path (`edge.http.writer`: a deadline
per piece), and what ends it (a refused head, a request sent too slowly, a write
that cannot progress, an HTTP/2 flood or unread streams: GOAWAY). It does not
parse HTTP (hypercorn's protocol classes and h11/h2 do), and knows nothing of the
app it serves, of other connections, or of its server beyond `ConnectionHost`.

Time limits on what a client sends (hypercorn's `read_timeout` is one
deadline per read, so a client sending a byte just before each deadline
holds a connection forever): a connection with no request in progress is
closed `idle_timeout_s` after it went idle, whatever arrived meanwhile, so a
head sent slowly is cut then too (408 when part of a head had arrived); an
HTTP/1.1 request body gets `body_timeout_s` of waiting on the client in all
(time spent while the edge itself is not reading does not count), then 408
and the connection closes. HTTP/2 bodies are bounded by the app's own body
timeout (Quart's BODY_TIMEOUT).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState, LifespanState
from hypercorn.utils import parse_socket_addr

from edge.http.headcheck import (
    H2_MAX_HEADER_LIST_SIZE,
    H2_RESET_BURST,
    H2_RESETS_PER_S,
    H2Limits,
    HeadScanner,
    Rejection,
)
from edge.http.refusals import REASONS, ConnectionErrors, error_response, goaway_frame
from edge.http.stalls import StallCount, Stalls, Unwritten
from edge.http.writer import Writer

# A read takes at most this much: just under 64 KiB, so that its buffer (the size
# asked for, cut to what came) comes from the heap, not from a mapping of its own made
# and unmade for each read (the allocator's mmap threshold is 64 KiB,
# `edge.process.allocator`): ~1.6 mmap and munmap calls fewer per request.
MAX_RECV = 2**16 - 1024
# Once a connection is over, its handlers (told `http.disconnect`) get this long
# to end before they are cancelled: in hypercorn 0.18.0 an HTTP/2 handler that
# is sending when its connection closes waits forever for a stream buffer that
# no task drains any more (its send task has ended), and would hold the
# connection's slot until shutdown (upstream, related: pgjones/hypercorn #308,
# HTTP/2 connections that never finish). A wait inside a shielded scope, as the
# app's end of response, runs out its own deadline first.
_HANDLER_GRACE_S = 1.0
# A request answered before it all came (shed, or refused by the app from its head):
# how long, and how much of the rest of it, is read and dropped after the answer
# before the close (so that it is not a reset).
_LINGER_S = 0.5
_LINGER_BYTES = 2**20
# HTTP/2 bytes handed to hypercorn per scheduler pass (~146 frames of the smallest kind).
_H2_PIECE = 2**11
_H2_LIMITS = H2Limits(H2_MAX_HEADER_LIST_SIZE, H2_RESET_BURST, H2_RESETS_PER_S)
# How long a GOAWAY waits for a write in progress before the connection closes anyway.
_GOAWAY_WAIT_S = 1.0
_ENHANCE_YOUR_CALM = 0xB


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """The bounds on every connection of a server, and on how many it holds."""

    max_connections: int
    slow_client_s: float
    idle_timeout_s: float = 5.0
    body_timeout_s: float = 60.0


class Shed(Protocol):
    """Answers a new HTTP/1.1 request from its request line alone (an overloaded
    edge's 503), or None: the request goes on to the app. `close`: the answer must
    close the connection (the rest of the request has not arrived with its head)."""

    def __call__(self, request_line: bytes, *, close: bool) -> bytes | None: ...


class ConnectionHost(Protocol):
    """What a connection reads of the server that accepted it (`edge.http.server`)."""

    config: HypercornConfig
    limits: ServerLimits
    app: AppWrapper  # the ASGI app, as hypercorn's protocol calls it
    context: WorkerContext  # `terminated` is set when the server drains
    lifespan_state: LifespanState
    errors: ConnectionErrors  # where what ends a connection is counted and logged
    stalls: Stalls  # the watch over HTTP/2 streams left unread, server-wide
    turn: Callable[[], Awaitable[None]]  # a new request with a body waits its turn...
    shed: Shed | None  # ...unless this answers it at once, from its request line
    write_deadline: float  # past it (the end of a drain) no write waits on its client


class ReadDeadlines:
    """How long a connection waits on its client, by whether a request is in progress.

    Idle (between requests): until `idle_timeout_s` after it went idle, whatever
    arrives meanwhile. A request body: `body_timeout_s` of receives in all. Each
    receive runs in `scope`, whose deadline is the nearer of the two.
    """

    __slots__ = (
        "_body_left", "_draining", "_idle_deadline", "_limits", "_started",
        "body_deadline", "idle", "idle_again", "scope", "served_any",
    )  # fmt: skip

    def __init__(self, limits: ServerLimits, draining: Callable[[], bool]) -> None:
        self._limits = limits
        self._draining = draining
        self.idle = True
        # A request on this connection reached the app (hypercorn said "busy" once).
        self.served_any = False
        self.idle_again = trio.Event()  # set when the answer in flight is done
        # When an idle connection closes (inf while a request is in progress).
        self._idle_deadline = math.inf
        # What is left of the time the edge waits on the current request body.
        self._body_left = limits.body_timeout_s
        # The receive in progress: when it began, and when its body time runs out.
        self.scope = trio.CancelScope()
        self._started = 0.0
        self.body_deadline = math.inf

    def first(self) -> trio.CancelScope:
        """The wait for a new connection's first bytes: `idle_timeout_s` from now."""
        self.scope = trio.CancelScope(deadline=trio.current_time() + self._limits.idle_timeout_s)
        return self.scope

    def set_idle(self, idle: bool) -> None:
        """hypercorn's word: a request is in progress (`idle` False), or none is."""
        self.idle = idle
        if not idle:
            self.served_any = True
            if self.idle_again.is_set():
                self.idle_again = trio.Event()
            self._idle_deadline = math.inf
            return  # the read loop sets the next receive's deadline itself
        self.idle_again.set()
        if self._draining():
            self._idle_deadline = -math.inf
        else:
            self._idle_deadline = trio.current_time() + self._limits.idle_timeout_s
        self.scope.deadline = self._idle_deadline

    def close_if_idle(self) -> None:
        """Shutdown: a connection between requests closes now; a busy one after its answer."""
        if self.idle:
            self._idle_deadline = -math.inf
            self.scope.deadline = -math.inf

    def receive(self, in_body: bool) -> trio.CancelScope:
        """The scope of the next receive (a cancel scope enters once: each gets a fresh
        one); `in_body`: it waits on a request body, and only time spent in it counts."""
        self._started = trio.current_time()
        self.body_deadline = self._started + self._body_left if in_body else math.inf
        self.scope = trio.CancelScope(deadline=min(self._idle_deadline, self.body_deadline))
        return self.scope

    def received(self, now: float) -> None:
        """The receive ended at `now`: the wait is taken off the body's time."""
        if self.body_deadline != math.inf:
            self._body_left -= now - self._started

    def body_done(self) -> None:
        """No body is owed: the next one gets `body_timeout_s` whole."""
        self._body_left = self._limits.body_timeout_s

    def overdue(self, mid_head: bool) -> str | None:
        """The receive's deadline passed: why, when the client sent a request too slowly
        (`mid_head`: part of a head had arrived); None: a normal idle close."""
        limits = self._limits
        if trio.current_time() >= self.body_deadline:
            return f"request body not received within {limits.body_timeout_s:g}s"
        if self.idle and mid_head:
            return f"request head not received within {limits.idle_timeout_s:g}s"
        return None  # idle past idle_timeout_s


class Connection:
    """One client connection: socket bytes in and out of hypercorn's protocol."""

    def __init__(
        self,
        host: ConnectionHost,
        stream: trio.SocketStream,
        nursery: trio.Nursery,
        first: bytes = b"",
    ) -> None:
        self.host = host
        self.stream = stream
        self._nursery = nursery  # the host's connections: where a GOAWAY is written from
        # Its HTTP/2 streams left unread (edge.http.stalls), once it is served.
        self.stall_count: StallCount | None = None
        self._calming = False
        # HTTP/2 answer bytes handed to hypercorn and not written yet (`handed`).
        self._unwritten = Unwritten()
        # What the client sent before the connection's task began (read by the host).
        self._first = first
        self._out = Writer(host, stream, host.limits.slow_client_s, self._close)
        self._scanner = HeadScanner(host.config.h11_max_incomplete_size, _H2_LIMITS)
        self._protocol: ProtocolWrapper | None = None
        self._reads = ReadDeadlines(host.limits, host.context.terminated.is_set)
        # Answered before its request all came: the read loop lingers, then closes.
        self._lingering = False

    @property
    def served_any(self) -> bool:
        """A request on this connection reached the app."""
        return self._reads.served_any

    async def run(self, wait: bool = True) -> None:
        """Serve the connection; `wait`: until it sends something first (else it has)."""
        sock = self.stream.socket
        # Nothing of hypercorn's is built for a connection until it sends something:
        # a flood of idle connections costs an accept and a wait each.
        scope = self._reads.first()
        if wait:
            with scope:
                await trio.lowlevel.wait_readable(sock)
            if scope.cancelled_caught:
                return  # idle past idle_timeout_s, or the edge is draining
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
        except OSError:
            return  # the client left before we looked
        with trio.CancelScope() as handlers:
            async with TaskGroup() as task_group:
                config = self.host.config
                app, self.stall_count = self.host.stalls.watch(self.host.app, self)
                self._protocol = ProtocolWrapper(
                    app, config, self.host.context, task_group,
                    ConnectionState(dict(self.host.lifespan_state)), False, client, server,
                    self._protocol_send, "http/1.1",
                )  # fmt: skip
                await self._protocol.initiate()
                self._reads.set_idle(True)
                await self._read_loop(self._protocol)
                handlers.deadline = trio.current_time() + _HANDLER_GRACE_S

    @property
    def open(self) -> bool:
        return not self._out.closed

    def calm_down(self, why: str) -> None:
        """Close the connection with GOAWAY (ENHANCE_YOUR_CALM): too many of its HTTP/2
        streams, or one for too long, are left unread (`edge.http.stalls`)."""
        if self._out.closed or self._calming:
            return
        self._calming = True
        self.host.errors.record("h2_stalled_streams", why)
        self._nursery.start_soon(self._goaway, why.encode())

    async def handed(self, nbytes: int) -> None:
        """An HTTP/2 answer's `nbytes` went to hypercorn: wait while the connection holds
        more than H2_MAX_UNWRITTEN unwritten (see `edge.http.stalls`)."""
        await self._unwritten.handed(nbytes)

    def drain(self, write_deadline: float) -> None:
        """Shutdown: a connection between requests closes now, a busy one after its
        answer; a write in progress gives up at `write_deadline` at the latest."""
        self._reads.close_if_idle()
        self._out.bound(write_deadline)

    async def _read_loop(self, protocol: ProtocolWrapper) -> None:
        reads = self._reads
        bodies = 0
        while not self._out.closed and not self._lingering:
            scope = reads.receive(self._scanner.in_body)
            # The last read is let go before the next wait: a connection whose client
            # then sends nothing (it streams an answer, or stalls) holds no read of it.
            forward = b""
            data, self._first = self._first, b""
            if not data:
                with scope:
                    try:
                        data = await self.stream.receive_some(MAX_RECV)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        break
            if scope.cancelled_caught or self._lingering:
                await self._timed_out()
                break
            now = trio.current_time()
            reads.received(now)
            if not data:
                await protocol.handle(RawData(b""))
                break
            if self._scanner.checking:
                forward, rejection = self._scanner.feed(data, now)
                if not self._scanner.in_body:
                    reads.body_done()
            else:
                forward, rejection = data, None
            if forward:
                if self._scanner.bodies != bodies:  # a new request that costs
                    bodies = self._scanner.bodies
                    shed = _shed(self.host.shed, reads.idle, self._scanner, forward)
                    if shed is not None:
                        answer, whole = shed
                        if whole:  # the request ended in this read: the connection goes on
                            try:
                                await self._out.write(answer)
                            except (trio.BrokenResourceError, trio.ClosedResourceError):
                                break
                            continue
                        await self._out.last(answer)  # then linger and close
                        await self._linger_and_close()
                        break
                    await self.host.turn()
                if len(forward) > _H2_PIECE and self._scanner.http2 is not None:
                    await self._handle_in_pieces(protocol, forward)
                else:
                    await protocol.handle(RawData(forward))
            if rejection is not None:
                await self._reject(rejection)
                break
        await protocol.handle(Closed())
        if self._lingering:
            await self._linger_and_close()

    async def _handle_in_pieces(self, protocol: ProtocolWrapper, data: bytes) -> None:
        """HTTP/2 bytes to hypercorn a piece at a time, with a scheduler pass between:
        a read of small frames (64 KiB of PRIORITY frames is ~4,700 of them, tens of
        milliseconds in h2 and hypercorn) is not one step that holds up every other."""
        view = memoryview(data)
        for start in range(0, len(view), _H2_PIECE):
            if start:
                await trio.lowlevel.checkpoint()
                if self._out.closed:
                    return
            await protocol.handle(RawData(bytes(view[start : start + _H2_PIECE])))

    async def _linger_and_close(self) -> None:
        """Close without a reset after an answer to a request not all read: the write
        side is shut, then what the client still sends of the request is read and
        dropped for a moment (bounded). A close with bytes unread sends a RST, which
        can destroy the answer before the client reads it (on a lossy network)."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self.stream.send_eof()
            with trio.move_on_after(_LINGER_S):
                left = _LINGER_BYTES
                while left > 0 and (data := await self.stream.receive_some(MAX_RECV)):
                    left -= len(data)
        await self._close()

    async def _timed_out(self) -> None:
        """A receive's deadline passed: a normal idle close, or a request sent too slowly."""
        if self._out.closed or self._lingering or self.host.context.terminated.is_set():
            return
        what = self._reads.overdue(self._scanner.mid_head)
        if what is None:
            return
        self.host.errors.record("slow_request", what)
        # A 408 unless part of an answer went out already (then only the close).
        if self._scanner.http2 is None:
            answer = error_response(
                408, REASONS[408], what, "request_timeout", "invalid_request_error"
            )
            await self._out.last(answer, unanswered=True)
        await self._close()

    async def _reject(self, rejection: Rejection) -> None:
        self.host.errors.record(rejection.kind, f"{rejection.status} {rejection.message}")
        watch = self._scanner.http2
        if watch is not None:
            # HTTP/2: GOAWAY at once (RFC 9113 5.4.1), then the connection ends.
            await self._goaway(rejection.message.encode())
            return
        # A request before it in the same packet (pipelining) is answered first.
        await self._reads.idle_again.wait()
        if not self._out.closed:
            answer = error_response(
                rejection.status, REASONS.get(rejection.status, "Bad Request"),
                rejection.message, rejection.code, "invalid_request_error",
            )  # fmt: skip
            await self._out.last(answer)
        await self._close()

    async def _goaway(self, debug: bytes) -> None:
        """GOAWAY (ENHANCE_YOUR_CALM) with `debug`, then close: every stream on the
        connection ends, each request's run with it."""
        watch = self._scanner.http2
        frame = goaway_frame(
            watch.last_stream_id if watch is not None else 0, _ENHANCE_YOUR_CALM, debug
        )
        with trio.move_on_after(_GOAWAY_WAIT_S):  # the frame goes out between two others
            await self._out.last(frame)
        await self._close()

    async def _protocol_send(self, event: Event) -> None:
        assert self._protocol is not None
        if isinstance(event, RawData):
            data: bytes | memoryview = event.data
            if self._scanner.http2 is not None:  # its first bytes then begin a frame
                self._unwritten.wrote(data)
            try:
                await self._out.send(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self._protocol.handle(Closed())
        elif isinstance(event, Closed):
            if self._scanner.in_body and not self._out.closed:
                # Answered before the body all came (an API key's 429 from its head).
                self._lingering = True
                self._reads.scope.cancel()
            else:
                await self._close()
            await self._protocol.handle(Closed())
        elif isinstance(event, Updated):
            if not event.idle:
                self._out.answered = 0
            self._reads.set_idle(event.idle)

    async def _close(self) -> None:
        if self._out.closed:
            return
        self._out.closed = True
        self._unwritten.end()  # no more waiting on a window
        self._reads.idle_again.set()
        self._reads.scope.cancel()
        try:
            await self.stream.send_eof()
        except (trio.BrokenResourceError, trio.BusyResourceError, trio.ClosedResourceError):
            pass
        except OSError:
            pass
        await self.stream.aclose()


def _shed(
    shed: Shed | None, idle: bool, scanner: HeadScanner, forward: bytes
) -> tuple[bytes, bool] | None:
    """`shed`'s own answer to the request whose head starts `forward` if it sheds it
    now (only on a connection with nothing else in progress, `idle`), and whether
    `forward` is that whole request and nothing more (then the connection is kept:
    the answer is written and the request dropped; else it closes after it)."""
    line = scanner.body_request_line
    if shed is None or not idle or not forward.startswith(line):
        return None
    head_end = forward.find(b"\r\n\r\n") + 4
    whole = (
        scanner.body_length > 0
        and head_end >= 4
        and len(forward) == head_end + scanner.body_length
        and not scanner.in_body
    )
    answer = shed(line, close=not whole)
    return None if answer is None else (answer, whole)
