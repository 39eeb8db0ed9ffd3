"""Serve an ASGI app with hypercorn's protocol classes, one connection contained at a time.

The edge's own HTTP serving loop: listeners, the accept loop, and one task per
connection that has sent something (`edge.http.connection`). Owns which
connections exist (and how many may: past the limit one is answered 503 and
closed), the wait of those that sent nothing yet (the set of
`edge.http.waiting`), the HTTP/2 settings and the unread-stream watch shared by
every connection, the lifespan of the ASGI app, and the drain (stop accepting,
close idle connections, let busy ones finish within `graceful_timeout`). What
ends one connection is that connection's own business. It does not parse HTTP
(hypercorn's protocol classes and h11/h2 do) and knows nothing of the app it
serves.

Why not `hypercorn.trio.serve`: in hypercorn 0.18.0 (the version the edge pins) an
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
"""

from __future__ import annotations

import errno
import math
import os
import socket
from collections.abc import Awaitable, Callable, Sequence

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import Framework, LifespanState
from hypercorn.utils import repr_socket_addr, wrap_app

from edge.http.connection import MAX_RECV, Connection, ServerLimits, Shed
from edge.http.headcheck import (
    H2_MAX_CONCURRENT_STREAMS,
    H2_MAX_HEADER_LIST_SIZE,
    H2_MAX_INBOUND_FRAME_SIZE,
)
from edge.http.refusals import ConnectionErrors, describe, over_limit_response
from edge.http.stalls import Stalls
from edge.http.waiting import Waiting
from edge.observe.metrics import EdgeMetrics

# Over-limit connections being answered 503 at once; past it they are just closed.
_MAX_REFUSING = 64
_REFUSE_DEADLINE_S = 0.25
_ACCEPT_BACKOFF_S = (0.01, 1.0)
# Connections taken from the listen queue per wakeup of the accept loop.
ACCEPT_BURST = 64
_FD_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# HTTP/2 streams a client leaves unread, its flow-control window closed (edge.http.stalls):
# a body send still waiting after H2_STALL_S makes its stream stalled; past this many
# on one connection, or in the whole server, the connection is closed with GOAWAY.
H2_STALL_S = 0.25
H2_MAX_STALLED_PER_CONNECTION = 16
H2_MAX_STALLED = 128
_OVER_LIMIT = over_limit_response()


class HttpServer:
    """One edge's HTTP server: listeners, connections, their limits and their drain."""

    def __init__(
        self,
        app: Framework,
        config: HypercornConfig,
        limits: ServerLimits,
        metrics: EdgeMetrics,
        *,
        turn: Callable[[], Awaitable[None]],
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
        self._connections: set[Connection] = set()
        # Accepted connections that have sent nothing yet (see _accept_loop); None where
        # the platform's selector cannot be waited on (each then waits in a task).
        self._waiting = Waiting.open()
        self._refusing = 0
        # Past the drain deadline no write waits on its client any more.
        self.write_deadline = math.inf
        self.lifespan_state: LifespanState = {}
        # A new request with a body takes a turn before the HTTP parser sees it...
        self.turn = turn
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
                    connection.drain(self.write_deadline)
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
        connection = Connection(self, stream, nursery, first)
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
        connection = Connection(self, stream, nursery)
        self._connections.add(connection)
        self._gauge.inc()
        nursery.start_soon(self._serve_connection, connection)

    async def _serve_connection(self, connection: Connection, wait: bool = True) -> None:
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
