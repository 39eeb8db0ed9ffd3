"""The write side of one connection: its bytes to the socket, one write at a time.

Owns the socket's writes and their deadlines: a write is cut into pieces, each
of which must go out within `slow_client_s` (and never past the end of a
drain), else the connection ends. One write goes out at a time, whole, so an
HTTP/2 frame is never interleaved with another. It knows nothing of HTTP or of
what it writes: the connection (`edge.http.connection`) says what goes out, and
its close is what a write that gives up calls.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from edge.http.refusals import ConnectionErrors

# A write is cut into pieces this big; each must go out within slow_client_s.
_WRITE_PIECE = 2**16


class WriteHost(Protocol):
    """What a connection's writes read of the server that accepted it."""

    errors: ConnectionErrors  # where a client that reads nothing is counted and logged
    write_deadline: float  # past it (the end of a drain) no write waits on its client


class Writer:
    """One connection's writes: one at a time, each piece within `slow_client_s`."""

    __slots__ = (
        "_close", "_host", "_lock", "_scope", "_slow_client_s", "_stream", "answered", "closed",
    )  # fmt: skip

    def __init__(
        self,
        host: WriteHost,
        stream: trio.SocketStream,
        slow_client_s: float,
        close: Callable[[], Awaitable[None]],
    ) -> None:
        self._host = host
        self._stream = stream
        self._slow_client_s = slow_client_s
        self._close = close  # the connection's close: a write that gives up ends it
        # The connection is over: nothing more is written (set by its close).
        self.closed = False
        # Answer bytes sent (`send`) since the request in progress began (the connection
        # sets it back to 0 then).
        self.answered = 0
        self._lock = trio.Lock()
        self._scope: trio.CancelScope | None = None  # the piece being written

    def bound(self, deadline: float) -> None:
        """Drain: a write in progress gives up at `deadline` at the latest."""
        scope = self._scope
        if scope is not None:
            scope.deadline = min(scope.deadline, deadline)

    async def send(self, data: bytes | memoryview) -> None:
        """Bytes of an answer (hypercorn's), after any write in progress.

        Raises trio.BrokenResourceError or trio.ClosedResourceError when the
        connection cannot take them.
        """
        self.answered += len(data)
        lock = self._lock
        if not lock.locked() and not self.closed:
            # The common case, one SSE frame: the kernel takes it whole at once, with
            # no lock, deadline or scheduler pass (each costs more than the syscall).
            sent = self._write_now(data)
            if sent == len(data):
                return
            if sent < 0:
                raise trio.BrokenResourceError
            if sent:
                # Part of it went out: the rest follows before anything else
                # (nothing ran in between, so the lock is free), whatever happens.
                lock.acquire_nowait()
                try:
                    await self._write(memoryview(data)[sent:])
                finally:
                    lock.release()
                return
        async with lock:
            await self._write(data)

    async def write(self, data: bytes) -> None:
        """`data` (an answer of the edge's own), after any write in progress.

        Raises trio.BrokenResourceError or trio.ClosedResourceError when the
        connection cannot take it.
        """
        async with self._lock:
            await self._write(data)

    async def last(self, data: bytes, *, unanswered: bool = False) -> None:
        """An answer the connection closes after: written if the client still takes it
        (`unanswered`: and if no byte of an answer to the request in progress was sent)."""
        async with self._lock:
            if unanswered and self.answered:
                return
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._write(data)

    def _write_now(self, data: bytes | memoryview) -> int:
        """Write what the socket takes without waiting: the bytes sent, -1 if it broke.

        trio's socket is non-blocking, so os.write returns what the kernel took (or
        BlockingIOError). The descriptor is asked for each time: a closed socket says -1,
        never a number the kernel may have given to another connection since.
        """
        fd = self._stream.socket.fileno()
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
        if self.closed:
            raise trio.ClosedResourceError
        host = self._host
        limit = self._slow_client_s
        view = memoryview(data)
        for start in range(0, len(view), _WRITE_PIECE):
            # One scope: shielded from outside, yet cancelled by its own deadline
            # (never later than the end of a drain).
            deadline = min(trio.current_time() + limit, host.write_deadline)
            with trio.CancelScope(shield=True, deadline=deadline) as scope:
                self._scope = scope
                await self._stream.send_all(view[start : start + _WRITE_PIECE])
            self._scope = None
            if scope.cancelled_caught:
                # Past the end of a drain it is not the client's doing.
                if trio.current_time() < host.write_deadline:
                    host.errors.record(
                        "slow_client", f"client read nothing for {limit:g}s: connection closed"
                    )
                await self._close()
                raise trio.ClosedResourceError
