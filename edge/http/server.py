# The edge's own HTTP serving loop: listeners, accept loop, one task per
# connection that has sent something, and the byte stream between each socket
# and hypercorn's protocol.
#
# Owns: which connections exist (and how many may), what ends one (an
# exception, a refused head, a write that cannot progress, idleness, a request
# that arrives too slowly, an HTTP/2 flood), the HTTP/2 protocol limits, the
# lifespan of the ASGI app, and the drain (stop accepting, close idle
# connections, let busy ones finish within `graceful_timeout`). It does not
# parse HTTP (hypercorn's protocol classes and h11/h2 do, after the head
# checks of `edge.http.headcheck`) and knows nothing of the app it serves.
"""Serve an ASGI app with hypercorn's protocol classes, one connection contained at a time.

Why not `hypercorn.trio.serve`: in hypercorn 0.18.0 (the newest release) an
exception raised while serving one connection escapes `trio.serve_listeners`
and ends `trio.run`. One packet does it: a malformed h2c upgrade, HTTP/2 DATA
on an answered stream, a PRIORITY flood, a WebSocket upgrade with a trailing
byte (upstream: pgjones/hypercorn issues #197, #225, #329; PRs #228, #312,
#334, #365). Its socket writes are also shielded without a deadline, so a
client that stops reading keeps its connection forever, and its accept loop
logs a traceback every 100 ms at the file-descriptor limit.

So the edge runs its own accept loop and connection class on hypercorn's
public building blocks (`ProtocolWrapper`, `TaskGroup`, `WorkerContext`,
`Lifespan`, `Config`), without touching their insides: each connection runs
inside its own `except* Exception`, so whatever it raises closes it, is
counted (`iop_edge_connection_errors_total{kind="exception"}`) and logged (a
line per kind per second at most), and never reaches another connection.

A connection that has sent nothing yet has no task: it waits in `edge.http.waiting`
(a selector of the server's own, watched through its one descriptor) until
it sends, ends, or reaches `idle_timeout_s`; a flood of idle connections costs
an accept and a registration each, and a request behind them is not kept
waiting while tasks are made for them.

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
import errno
import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, Framework, LifespanState
from hypercorn.utils import parse_socket_addr, repr_socket_addr, wrap_app

from edge.fleet.turns import Turns
from edge.http.headcheck import (
    H2_MAX_CONCURRENT_STREAMS,
    H2_MAX_HEADER_LIST_SIZE,
    H2_MAX_INBOUND_FRAME_SIZE,
    H2_RESET_BURST,
    H2_RESETS_PER_S,
    H2Limits,
    HeadScanner,
    Rejection,
)
from edge.http.refusals import (
    REASONS,
    ConnectionErrors,
    describe,
    error_response,
    goaway_frame,
    over_limit_response,
)
from edge.http.stalls import DataWritten, StallCount, Stalls
from edge.http.waiting import Waiting
from edge.observe.metrics import EdgeMetrics

MAX_RECV = 2**16
# A write is cut into pieces this big; each must go out within slow_client_s.
_WRITE_PIECE = 2**16
# Over-limit connections being answered 503 at once; past it they are just closed.
_MAX_REFUSING = 64
_REFUSE_DEADLINE_S = 0.25
# Once a connection is over, its handlers (told `http.disconnect`) get this long
# to end before they are cancelled: in hypercorn 0.18.0 an HTTP/2 handler that
# is sending when its connection closes waits forever for a stream buffer that
# no task drains any more (its send task has ended), and would hold the
# connection's slot until shutdown; no upstream fix yet (related: pgjones/hypercorn
# issue #308, HTTP/2 connections that never finish). A wait inside a shielded
# scope, as the app's end of response, runs out its own deadline first.
_HANDLER_GRACE_S = 1.0
_ACCEPT_BACKOFF_S = (0.01, 1.0)
# A shed request's connection: how long, and how much of the rest of the request,
# is read and dropped after the answer before the close (so it is not a reset).
_LINGER_S = 0.5
_LINGER_BYTES = 2**20
# Connections taken from the listen queue per wakeup of the accept loop.
ACCEPT_BURST = 64
_FD_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# HTTP/2 bytes handed to hypercorn per scheduler pass (~146 frames of the smallest kind).
_H2_PIECE = 2**11
_H2_LIMITS = H2Limits(H2_MAX_HEADER_LIST_SIZE, H2_RESET_BURST, H2_RESETS_PER_S)
# HTTP/2 streams a client leaves unread, its flow-control window closed (edge.http.stalls):
# a body send still waiting after H2_STALL_S makes its stream stalled; past this many
# on one connection, or in the whole server, the connection is closed with GOAWAY.
H2_STALL_S = 0.25
# Answer bytes an HTTP/2 connection may hold unwritten (its client's windows closed);
# past it, the answers' sends wait (and so count as stalled).
H2_MAX_UNWRITTEN = 2**20
H2_MAX_STALLED_PER_CONNECTION = 16
H2_MAX_STALLED = 128
# How long a GOAWAY waits for a write in progress before the connection closes anyway.
_GOAWAY_WAIT_S = 1.0
_ENHANCE_YOUR_CALM = 0xB
_OVER_LIMIT = over_limit_response()


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_connections: int
    slow_client_s: float
    idle_timeout_s: float = 5.0
    body_timeout_s: float = 60.0


class Shed(Protocol):
    """Answers a new HTTP/1.1 request from its request line alone, or None (see
    `HttpServer`); `close`: the answer must close the connection."""

    def __call__(self, request_line: bytes, *, close: bool) -> bytes | None: ...


class HttpServer:
    """One edge's HTTP server: listeners, connections, their limits and their drain."""

    def __init__(
        self,
        app: Framework,
        config: HypercornConfig,
        limits: ServerLimits,
        metrics: EdgeMetrics,
        *,
        turns: Turns,
        shed: Shed | None = None,
        accept_burst: int = ACCEPT_BURST,
    ) -> None:
        # The HTTP/2 limits are the server's: whatever the caller set is replaced.
        config.h2_max_concurrent_streams = H2_MAX_CONCURRENT_STREAMS
        config.h2_max_header_list_size = H2_MAX_HEADER_LIST_SIZE
        config.h2_max_inbound_frame_size = H2_MAX_INBOUND_FRAME_SIZE
        self.config = config
        self.limits = limits
        self.errors = ConnectionErrors(metrics)
        self._gauge = metrics.open_connections
        self._without_request = metrics.connections_without_request
        self.app = wrap_app(app, config.wsgi_max_body_size, "asgi")
        self.context = WorkerContext(None)
        self._connections: set[_Connection] = set()
        # Accepted connections that have sent nothing yet (see _accept_loop); None where
        # the platform's selector cannot be waited on (each then waits in a task).
        self._waiting = Waiting.open()
        self._refusing = 0
        # Past the drain deadline no write waits on its client any more.
        self.write_deadline = math.inf
        self.lifespan_state: LifespanState = {}
        # A new request with a body takes a turn before the HTTP parser sees it...
        self.turns = turns
        # Connections taken per wakeup of the accept loop: 1 where other processes
        # accept from the same socket (a burst would take their share too).
        self.accept_burst = accept_burst
        # ...unless `shed(request_line, close=...)` answers it at once (an overloaded
        # edge's 503): then that answer is written, nothing parsed.
        self.shed = shed
        self.stalls = Stalls(
            stall_s=H2_STALL_S, per_connection=H2_MAX_STALLED_PER_CONNECTION,
            total=H2_MAX_STALLED, limit_s=limits.slow_client_s,
            gauge=metrics.h2_stalled_streams,
        )  # fmt: skip

    @property
    def open_connections(self) -> int:
        waiting = len(self._waiting) if self._waiting is not None else 0
        return len(self._connections) + waiting

    async def serve(
        self,
        host: str,
        port: int,
        shutdown: trio.Event,
        *,
        sockets: Sequence[socket.socket] = (),
        task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until `shutdown` is set, then drain within `graceful_timeout`.

        `sockets`: listening sockets bound already (a worker process gets its
        supervisor's); `host` and `port` are then not bound. The drain closes them
        (this process's descriptors: another process's copies stay open).
        """
        lifespan = Lifespan(self.app, self.config, self.lifespan_state)
        async with trio.open_nursery() as lifespan_nursery:
            await lifespan_nursery.start(lifespan.handle_lifespan)
            await lifespan.wait_for_startup()
            async with trio.open_nursery() as connections:
                if sockets:
                    listeners = [
                        trio.SocketListener(trio.socket.from_stdlib_socket(sock))
                        for sock in sockets
                    ]
                else:
                    listeners = await trio.open_tcp_listeners(
                        port, host=host, backlog=self.config.backlog
                    )
                binds = [
                    f"http://{repr_socket_addr(lst.socket.family, lst.socket.getsockname())}"
                    for lst in listeners
                ]
                task_status.started(binds)
                try:
                    async with trio.open_nursery() as accepting:
                        if self._waiting is not None:
                            accepting.start_soon(self._watch_waiting, self._waiting, connections)
                        accepting.start_soon(self.stalls.run)
                        for listener in listeners:
                            accepting.start_soon(self._accept_loop, listener, connections)
                        await shutdown.wait()
                        accepting.cancel_scope.cancel()
                finally:
                    for listener in listeners:
                        listener.socket.close()
                    if self._waiting is not None:
                        # Draining: a connection that sent nothing is closed at once.
                        for sock in self._waiting.take_all():
                            self._unused(sock)
                        self._waiting.close()
                await self.context.terminated.set()
                self.write_deadline = trio.current_time() + self.config.graceful_timeout
                for connection in list(self._connections):
                    connection.close_if_idle()
                    connection.bound_write(self.write_deadline)
                connections.cancel_scope.deadline = self.write_deadline
            await lifespan.wait_for_shutdown()
            lifespan_nursery.cancel_scope.cancel()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        # A second handle on the listening socket takes the connections already
        # waiting without a pass of the scheduler each (trio's `accept` yields once
        # per connection: behind a burst of connects, a probe would wait one full
        # pass per connection ahead of it).
        with socket.socket(fileno=os.dup(listener.socket.fileno())) as waiting:
            waiting.setblocking(False)
            if self._waiting is not None:
                await self._accept_into_waiting(waiting, nursery)
                return
            backoff = _ACCEPT_BACKOFF_S[0]
            while True:
                try:
                    stream = await listener.accept()
                except trio.ClosedResourceError:
                    return
                except OSError as exc:
                    self._accept_failed(exc)
                    # Wait for a connection to end (or a short while) before trying again.
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, _ACCEPT_BACKOFF_S[1])
                    continue
                backoff = _ACCEPT_BACKOFF_S[0]
                await self._admit(stream, nursery)
                for _ in range(self.accept_burst - 1):
                    try:
                        sock, _addr = waiting.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError as exc:
                        self._accept_failed(exc)
                        break
                    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
                    await self._admit(stream, nursery)

    async def _accept_into_waiting(self, listening: socket.socket, nursery: trio.Nursery) -> None:
        """Accept up to `accept_burst` connections per wakeup straight into the waiting
        set: an accept and a registration each, nothing else until the client sends."""
        waiting = self._waiting
        assert waiting is not None
        idle_s = self.limits.idle_timeout_s
        backoff = _ACCEPT_BACKOFF_S[0]
        while True:
            await trio.lowlevel.wait_readable(listening)
            deadline = trio.current_time() + idle_s
            for _ in range(self.accept_burst):
                try:
                    sock, _addr = listening.accept()
                except (BlockingIOError, InterruptedError):
                    break  # another process took it, or none is left
                except OSError as exc:
                    self._accept_failed(exc)
                    # Wait for a connection to end (or a short while) before trying again.
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, _ACCEPT_BACKOFF_S[1])
                    break
                backoff = _ACCEPT_BACKOFF_S[0]
                sock.setblocking(False)
                if self.open_connections >= self.limits.max_connections:
                    await self._admit(
                        trio.SocketStream(trio.socket.from_stdlib_socket(sock)), nursery
                    )
                    continue
                self._gauge.inc()
                # A client that sent its request with its connect (most do) is served
                # from here; one that sent nothing yet waits apart.
                if not self._start_if_sent(sock, nursery):
                    waiting.add(sock, deadline)

    async def _watch_waiting(self, waiting: Waiting, nursery: trio.Nursery) -> None:
        """Start a connection's task once it sends; close it at idle_timeout_s if it does
        not, or at once if all it sent was its end (FIN or RST)."""
        selector = waiting.fileno()
        while True:
            with trio.CancelScope(deadline=waiting.next_deadline()) as scope:
                waiting.wake = scope
                await trio.lowlevel.wait_readable(selector)
            waiting.wake = None
            for sock in waiting.take_ready():
                if not self._start_if_sent(sock, nursery):
                    # Not readable after all: its task waits for it.
                    self._start(sock, b"", nursery)
            for sock in waiting.take_expired(trio.current_time()):
                self._unused(sock)

    def _start_if_sent(self, sock: socket.socket, nursery: trio.Nursery) -> bool:
        """Start the connection's task with what its client sent, or close it if all it
        sent was its end (FIN or RST); False when it has sent nothing yet."""
        try:
            first = sock.recv(MAX_RECV)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            first = b""  # reset
        if not first:
            self._unused(sock)
        else:
            self._start(sock, first, nursery)
        return True

    def _start(self, sock: socket.socket, first: bytes, nursery: trio.Nursery) -> None:
        """The task of a connection (counted open already) whose client sent `first`
        (b"": nothing yet, its task waits for it)."""
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        connection = _Connection(self, stream, nursery, first)
        self._connections.add(connection)
        nursery.start_soon(self._serve_connection, connection, not first)

    def _unused(self, sock: socket.socket) -> None:
        """A connection closed without having carried a request."""
        sock.close()
        self._gauge.dec()
        self._without_request.inc()

    def _accept_failed(self, exc: OSError) -> None:
        kind = "accept_fd_exhausted" if exc.errno in _FD_ERRNOS else "accept_error"
        self.errors.record(kind, f"accept failed: {exc.strerror or exc}")

    async def _admit(self, stream: trio.SocketStream, nursery: trio.Nursery) -> None:
        """Serve an accepted connection, or refuse it past `max_connections`."""
        if self.open_connections >= self.limits.max_connections:
            self.errors.record("over_limit", f"{self.limits.max_connections} connections open")
            if self._refusing < _MAX_REFUSING:
                self._refusing += 1
                nursery.start_soon(self._refuse, stream)
            else:
                await stream.aclose()
            return
        connection = _Connection(self, stream, nursery)
        self._connections.add(connection)
        self._gauge.inc()
        nursery.start_soon(self._serve_connection, connection)

    async def _serve_connection(self, connection: _Connection, wait: bool = True) -> None:
        try:
            await connection.run(wait)
        except* Exception as group:
            self.errors.record("exception", describe(group))
        finally:
            self._connections.discard(connection)
            self._gauge.dec()
            if connection.stall_count is not None:
                self.stalls.forget(connection.stall_count)
            if not connection.served_any:
                self._without_request.inc()
            await connection.stream.aclose()

    async def _refuse(self, stream: trio.SocketStream) -> None:
        """Answer 503 without reading the request, then close: a clear no, at once."""
        try:
            with trio.move_on_after(_REFUSE_DEADLINE_S):
                await stream.send_all(_OVER_LIMIT)
                await stream.send_eof()
                # Read the request head the client sent (not more), so that closing
                # does not reset the connection before the client reads the answer.
                seen = b""
                while b"\r\n\r\n" not in seen and len(seen) < MAX_RECV:
                    data = await stream.receive_some(MAX_RECV)
                    if not data:
                        break
                    seen = seen[-3:] + data
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self._refusing -= 1
            await stream.aclose()


class _Connection:
    """One client connection: socket bytes in and out of hypercorn's protocol."""

    def __init__(
        self,
        server: HttpServer,
        stream: trio.SocketStream,
        nursery: trio.Nursery,
        first: bytes = b"",
    ) -> None:
        self.server = server
        self.stream = stream
        self._nursery = nursery  # the server's connections: where a GOAWAY is written from
        # Its HTTP/2 streams left unread (edge.http.stalls), once it is served.
        self.stall_count: StallCount | None = None
        self._calming = False
        # HTTP/2 answer bytes handed to hypercorn and not written yet, and who waits
        # for them to go (`handed`); `_data` reads the DATA frames written.
        self._unwritten = 0
        self._data: DataWritten | None = None
        self._data_written: trio.Event | None = None
        # What the client sent before the connection's task began (read by the server).
        self._first = first
        self._send_lock = trio.Lock()
        self._scanner = HeadScanner(server.config.h11_max_incomplete_size, _H2_LIMITS)
        self._protocol: ProtocolWrapper | None = None
        self._idle = True
        # A request on this connection reached the app (hypercorn said "busy" once).
        self.served_any = False
        self._idle_again = trio.Event()  # set when the answer in flight is done
        # When an idle connection closes (inf while a request is in progress).
        self._idle_deadline = math.inf
        # What is left of the time the edge waits on the current request body.
        self._body_left = server.limits.body_timeout_s
        self._answer_bytes = 0  # written since the request in progress began
        self._read_scope = trio.CancelScope()
        self._closed = False
        self._write_scope: trio.CancelScope | None = None

    async def run(self, wait: bool = True) -> None:
        """Serve the connection; `wait`: until it sends something first (else it has)."""
        sock = self.stream.socket
        # Nothing of hypercorn's is built for a connection until it sends something:
        # a flood of idle connections costs an accept and a wait each.
        self._read_scope = trio.CancelScope(
            deadline=trio.current_time() + self.server.limits.idle_timeout_s
        )
        if wait:
            with self._read_scope:
                await trio.lowlevel.wait_readable(sock)
            if self._read_scope.cancelled_caught:
                return  # idle past idle_timeout_s, or the edge is draining
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
        except OSError:
            return  # the client left before we looked
        with trio.CancelScope() as handlers:
            async with TaskGroup() as task_group:
                await self._serve(task_group, client, server)
                handlers.deadline = trio.current_time() + _HANDLER_GRACE_S

    async def _serve(
        self, task_group: TaskGroup, client: tuple[str, int] | None, server: tuple[str, int] | None
    ) -> None:
        config = self.server.config
        app, self.stall_count = self.server.stalls.watch(self.server.app, self)
        self._protocol = ProtocolWrapper(
            app,
            config,
            self.server.context,
            task_group,
            ConnectionState(dict(self.server.lifespan_state)),
            False,
            client,
            server,
            self._protocol_send,
            "http/1.1",
        )
        await self._protocol.initiate()
        self._set_idle(True)
        await self._read_loop(self._protocol)

    @property
    def open(self) -> bool:
        return not self._closed

    def calm_down(self, why: str) -> None:
        """Close the connection with GOAWAY (ENHANCE_YOUR_CALM): too many of its HTTP/2
        streams, or one for too long, are left unread (`edge.http.stalls`)."""
        if self._closed or self._calming:
            return
        self._calming = True
        self.server.errors.record("h2_stalled_streams", why)
        self._nursery.start_soon(self._goaway, why.encode())

    async def handed(self, nbytes: int) -> None:
        """An HTTP/2 answer's `nbytes` went to hypercorn: wait while the connection holds
        more than H2_MAX_UNWRITTEN unwritten (see `edge.http.stalls`)."""
        self._unwritten += nbytes
        while self._unwritten > H2_MAX_UNWRITTEN and not self._closed:
            if self._data_written is None:
                self._data_written = trio.Event()
            await self._data_written.wait()

    def _wrote(self, data: bytes | memoryview) -> None:
        """Count the DATA payload bytes in what is written, once the connection is HTTP/2."""
        if self._data is None:
            if self._scanner.http2 is None:
                return
            self._data = DataWritten()  # the server's first HTTP/2 bytes: a frame begins
        written = self._data.feed(data)
        if written:
            self._unwritten -= written
            if self._data_written is not None and self._unwritten <= H2_MAX_UNWRITTEN:
                self._data_written.set()
                self._data_written = None

    def bound_write(self, deadline: float) -> None:
        """Drain: a write in progress gives up at `deadline` at the latest."""
        scope = self._write_scope
        if scope is not None:
            scope.deadline = min(scope.deadline, deadline)

    def close_if_idle(self) -> None:
        """Shutdown: a connection between requests closes now; a busy one after its answer."""
        if self._idle:
            self._idle_deadline = -math.inf
            self._read_scope.deadline = -math.inf

    def _set_idle(self, idle: bool) -> None:
        self._idle = idle
        if not idle:
            self.served_any = True
            self._answer_bytes = 0
            if self._idle_again.is_set():
                self._idle_again = trio.Event()
            self._idle_deadline = math.inf
            return  # the read loop sets the next receive's deadline itself
        self._idle_again.set()
        if self.server.context.terminated.is_set():
            self._idle_deadline = -math.inf
        else:
            self._idle_deadline = trio.current_time() + self.server.limits.idle_timeout_s
        self._read_scope.deadline = self._idle_deadline

    async def _read_loop(self, protocol: ProtocolWrapper) -> None:
        body_timeout_s = self.server.limits.body_timeout_s
        bodies = 0
        while not self._closed:
            started = trio.current_time()
            # Only time spent here, waiting on the client, counts against a body.
            body_deadline = started + self._body_left if self._scanner.in_body else math.inf
            # A cancel scope enters once: each receive gets a fresh one.
            self._read_scope = trio.CancelScope(deadline=min(self._idle_deadline, body_deadline))
            data, self._first = self._first, b""
            if not data:
                with self._read_scope:
                    try:
                        data = await self.stream.receive_some(MAX_RECV)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        break
            if self._read_scope.cancelled_caught:
                await self._timed_out(body_deadline)
                break
            now = trio.current_time()
            if body_deadline != math.inf:
                self._body_left -= now - started
            if not data:
                await protocol.handle(RawData(b""))
                break
            if self._scanner.checking:
                forward, rejection = self._scanner.feed(data, now)
                if not self._scanner.in_body:
                    self._body_left = body_timeout_s
            else:
                forward, rejection = data, None
            if forward:
                if self._scanner.bodies != bodies:  # a new request that costs
                    bodies = self._scanner.bodies
                    shed = self._shed(forward)
                    if shed is not None:
                        answer, whole = shed
                        if whole:  # the request ended in this read: the connection goes on
                            async with self._send_lock:
                                try:
                                    await self._write(answer)
                                except (trio.BrokenResourceError, trio.ClosedResourceError):
                                    break
                            continue
                        await self._answer_and_close(answer)
                        break
                    await self.server.turns.turn()
                if len(forward) > _H2_PIECE and self._scanner.http2 is not None:
                    await self._handle_in_pieces(protocol, forward)
                else:
                    await protocol.handle(RawData(forward))
            if rejection is not None:
                await self._reject(rejection)
                break
        await protocol.handle(Closed())

    async def _handle_in_pieces(self, protocol: ProtocolWrapper, data: bytes) -> None:
        """HTTP/2 bytes to hypercorn a piece at a time, with a scheduler pass between:
        a read of small frames (64 KiB of PRIORITY frames is ~4,700 of them, tens of
        milliseconds in h2 and hypercorn) is not one step that holds up every other."""
        view = memoryview(data)
        for start in range(0, len(view), _H2_PIECE):
            if start:
                await trio.lowlevel.checkpoint()
                if self._closed:
                    return
            await protocol.handle(RawData(bytes(view[start : start + _H2_PIECE])))

    def _shed(self, forward: bytes) -> tuple[bytes, bool] | None:
        """The server's own answer to the request whose head starts `forward` if the app
        sheds it now (only on a connection with nothing else in progress), and whether
        `forward` is that whole request and nothing more (then the connection is kept:
        the answer is written and the request dropped; else it closes after it)."""
        shed = self.server.shed
        scanner = self._scanner
        line = scanner.body_request_line
        if shed is None or not self._idle or not forward.startswith(line):
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

    async def _answer_and_close(self, answer: bytes) -> None:
        """Write `answer`, then close without a reset: what the client still sends of
        the request is read and dropped for a moment (bounded), so the answer is read."""
        async with self._send_lock:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._write(answer)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self.stream.send_eof()
            with trio.move_on_after(_LINGER_S):
                left = _LINGER_BYTES
                while left > 0 and (data := await self.stream.receive_some(MAX_RECV)):
                    left -= len(data)
        await self._close()

    async def _timed_out(self, body_deadline: float) -> None:
        """A receive's deadline passed: a normal idle close, or a request sent too slowly."""
        limits = self.server.limits
        if self._closed or self.server.context.terminated.is_set():
            return
        if trio.current_time() >= body_deadline:
            what = f"request body not received within {limits.body_timeout_s:g}s"
        elif self._idle and self._scanner.mid_head:
            what = f"request head not received within {limits.idle_timeout_s:g}s"
        else:
            return  # idle past idle_timeout_s
        self.server.errors.record("slow_request", what)
        async with self._send_lock:
            # A 408 unless part of an answer went out already (then only the close).
            if self._answer_bytes == 0 and self._scanner.http2 is None:
                answer = error_response(
                    408, REASONS[408], what, "request_timeout", "invalid_request_error"
                )
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._write(answer)
        await self._close()

    async def _reject(self, rejection: Rejection) -> None:
        self.server.errors.record(rejection.kind, f"{rejection.status} {rejection.message}")
        watch = self._scanner.http2
        if watch is not None:
            # HTTP/2: GOAWAY at once (RFC 9113 5.4.1), then the connection ends.
            await self._goaway(rejection.message.encode())
            return
        # A request before it in the same packet (pipelining) is answered first.
        await self._idle_again.wait()
        if not self._closed:
            answer = error_response(
                rejection.status, REASONS.get(rejection.status, "Bad Request"),
                rejection.message, rejection.code, "invalid_request_error",
            )  # fmt: skip
            async with self._send_lock:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._write(answer)
        await self._close()

    async def _goaway(self, debug: bytes) -> None:
        """GOAWAY (ENHANCE_YOUR_CALM) with `debug`, then close: every stream on the
        connection ends, each request's run with it."""
        watch = self._scanner.http2
        frame = goaway_frame(
            watch.last_stream_id if watch is not None else 0, _ENHANCE_YOUR_CALM, debug
        )
        with trio.move_on_after(_GOAWAY_WAIT_S):  # the frame goes out between two others
            async with self._send_lock:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._write(frame)
        await self._close()

    async def _protocol_send(self, event: Event) -> None:
        assert self._protocol is not None
        if isinstance(event, RawData):
            data: bytes | memoryview = event.data
            self._answer_bytes += len(data)
            self._wrote(data)
            lock = self._send_lock
            if not lock.locked() and not self._closed:
                # The common case, one SSE frame: the kernel takes it whole at once, with
                # no lock, deadline or scheduler pass (each costs more than the syscall).
                sent = self._write_now(data)
                if sent == len(data):
                    return
                if sent < 0:
                    await self._protocol.handle(Closed())
                    return
                if sent:
                    # Part of it went out: the rest follows before anything else
                    # (nothing ran in between, so the lock is free), whatever happens.
                    lock.acquire_nowait()
                    try:
                        await self._write(memoryview(data)[sent:])
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        await self._protocol.handle(Closed())
                    finally:
                        lock.release()
                    return
            async with lock:
                try:
                    await self._write(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._protocol.handle(Closed())
        elif isinstance(event, Closed):
            await self._close()
            await self._protocol.handle(Closed())
        elif isinstance(event, Updated):
            self._set_idle(event.idle)

    def _write_now(self, data: bytes | memoryview) -> int:
        """Write what the socket takes without waiting: the bytes sent, -1 if it broke.

        trio's socket is non-blocking, so os.write returns what the kernel took (or
        BlockingIOError). The descriptor is asked for each time: a closed socket says -1,
        never a number the kernel may have given to another connection since.
        """
        fd = self.stream.socket.fileno()
        if fd < 0:
            return -1
        try:
            return os.write(fd, data)
        except BlockingIOError:
            return 0
        except OSError:
            return -1

    async def _write(self, data: bytes | memoryview) -> None:
        """Send `data`; a piece that cannot go out within slow_client_s closes the connection.

        The send is shielded from outside cancellation (as hypercorn does: a
        half-written HTTP/2 frame would corrupt every other stream), but not
        from its own deadline.
        """
        if self._closed:
            raise trio.ClosedResourceError
        server = self.server
        limit = server.limits.slow_client_s
        view = memoryview(data)
        for start in range(0, len(view), _WRITE_PIECE):
            # One scope: shielded from outside, yet cancelled by its own deadline
            # (never later than the end of a drain).
            deadline = min(trio.current_time() + limit, server.write_deadline)
            with trio.CancelScope(shield=True, deadline=deadline) as scope:
                self._write_scope = scope
                await self.stream.send_all(view[start : start + _WRITE_PIECE])
            self._write_scope = None
            if scope.cancelled_caught:
                # Past the end of a drain it is not the client's doing.
                if trio.current_time() < server.write_deadline:
                    server.errors.record(
                        "slow_client", f"client read nothing for {limit:g}s: connection closed"
                    )
                await self._close()
                raise trio.ClosedResourceError

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._data_written is not None:  # no more waiting on a window
            self._data_written.set()
        self._idle_again.set()
        self._read_scope.cancel()
        try:
            await self.stream.send_eof()
        except (trio.BrokenResourceError, trio.BusyResourceError, trio.ClosedResourceError):
            pass
        except OSError:
            pass
        await self.stream.aclose()
