"""Accepted connections that wait, without a task or an object each, for their first bytes.

The waiting set: accepted connections that have sent nothing yet.

Owns their sockets until each sends something, ends, or reaches its
deadline, watched through a selector of its own (one descriptor for the whole
set). It does not read a byte, close a socket or make a task: the server
takes each one out (`take_ready`, `take_expired`, `take_all`) and decides.
No HTTP, no hypercorn: sockets, deadlines and a selector only.
"""

from __future__ import annotations

import math
import selectors
import socket
from collections import deque

import trio


class Waiting:
    """Accepted connections that have sent nothing yet, without a task or an object each.

    A flood of idle connections (or the connects of a burst of clients) costs an accept
    and a registration in a selector of the server's own, whose one descriptor the
    server waits on; a connection gets its task and its HTTP objects once it sends.
    Linux's epoll and the BSDs' kqueue can be waited on that way; elsewhere `open`
    says None and each connection waits in a task of its own.
    """

    __slots__ = ("_expiry", "_selector", "_socks", "wake")

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self._selector = selector
        self._socks: dict[int, socket.socket] = {}
        # (deadline, descriptor, socket), in the order accepted: deadlines only grow.
        self._expiry: deque[tuple[float, int, socket.socket]] = deque()
        # The watcher's wait, to move its deadline when the first connection arrives.
        self.wake: trio.CancelScope | None = None

    @classmethod
    def open(cls) -> Waiting | None:
        selector = selectors.DefaultSelector()
        if not hasattr(selector, "fileno"):
            selector.close()
            return None
        return cls(selector)

    def __len__(self) -> int:
        return len(self._socks)

    def fileno(self) -> int:
        return self._selector.fileno()  # type: ignore[attr-defined, no-any-return]

    def add(self, sock: socket.socket, deadline: float) -> None:
        fd = sock.fileno()
        self._selector.register(fd, selectors.EVENT_READ)
        self._socks[fd] = sock
        self._expiry.append((deadline, fd, sock))
        wake = self.wake
        if wake is not None and wake.deadline > deadline:
            wake.deadline = deadline

    def next_deadline(self) -> float:
        return self._expiry[0][0] if self._expiry else math.inf

    def take_ready(self) -> list[socket.socket]:
        """The connections that sent something (or their end), out of the set."""
        ready = []
        for key, _events in self._selector.select(0):
            ready.append(self._take(key.fd))
        return ready

    def take_expired(self, now: float) -> list[socket.socket]:
        expired = []
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, fd, sock = expiry.popleft()
            if self._socks.get(fd) is sock:  # else it left the set already
                expired.append(self._take(fd))
        return expired

    def take_all(self) -> list[socket.socket]:
        everything = [self._take(fd) for fd in list(self._socks)]
        self._expiry.clear()
        return everything

    def close(self) -> None:
        self._selector.close()

    def _take(self, fd: int) -> socket.socket:
        self._selector.unregister(fd)
        return self._socks.pop(fd)
