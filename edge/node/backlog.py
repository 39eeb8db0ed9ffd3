"""The output a process holds for clients that stop reading, bounded in sum: `Backlog`.

Each run's `edge.node.bridge.EventBuffer` is bounded on its own; a client that
stops reading fills it and its producer (the node's read loop) waits for room
until `[timeouts] slow_client_s`. The number of such runs is bounded only by the
connections and HTTP/2 streams a process serves, so their sum is not. One
`Backlog` per process (made by the daemon with the node clients, handed to each)
counts the delta text all the event buffers hold and knows the buffers whose
producer is waiting for room, oldest wait first. A waiting producer's stream
also holds what its buffer does not count (`BEYOND_BUFFER`: the node hop's
window of received frames, the chunk its writer holds), so each waiter adds that
much to the total while it waits. Past `budget` characters, the buffers waiting
longest are cut, as slow clients, until the total is back under it: a stalled
stream past the budget costs the process nothing more for the rest of
`slow_client_s`. A buffer whose producer is not waiting (its client reads) is
never a candidate.

Pure bookkeeping: no clock, no I/O. Buffers add and take characters on
`chars` themselves (an integer add per event); the work here runs when a
producer starts or stops waiting, and when the total passes the budget.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

# What a stream whose client stopped reading holds beyond its event buffer, counted
# while its producer waits: up to the node hop's stream window of frames grpclib
# received and nobody decoded (128 KiB, `edge.node.grpc`), the event waiting for
# room (up to a 64 KiB delta), and the chunk its writer holds rendered, encoded
# and framed for the socket (memray, a 64 KiB delta: about 85 KiB in each form):
# ~450 KiB; and what a migration keeps of its answer once its client stopped
# reading (at most 256 Ki characters, `edge.fleet.continuation.STALLED_CHARS`):
# ~700 KiB, counted as 768 Ki.
BEYOND_BUFFER = 768 * 1024


class Waiter(Protocol):
    """A buffer as the backlog sees it: one whose producer may wait for room."""

    def cut(self) -> None:
        """End the producer's wait as a slow client's, and leave the backlog (`release`)."""


class Backlog:
    """Characters of delta text held by a process's event buffers, and a budget for them.

    Attributes:
        chars: the characters held, added and taken by the buffers themselves.
        budget: past it, the producers waiting longest are cut (`over`).
        cuts: runs cut by the budget so far.
    """

    __slots__ = ("_on_cut", "_waiting", "budget", "chars", "cuts", "per_waiter")

    def __init__(
        self,
        budget: int = sys.maxsize,
        *,
        per_waiter: int = 0,
        on_cut: Callable[[], object] | None = None,
    ) -> None:
        self.budget = budget
        self.chars = 0
        self.cuts = 0
        # Added to `chars` for each producer while it waits (BEYOND_BUFFER in a process).
        self.per_waiter = per_waiter
        self._on_cut = on_cut
        # Buffers whose producer waits for room, in the order their waits began
        # (a dict keeps insertion order, and takes one out in constant time).
        self._waiting: dict[Waiter, None] = {}

    @property
    def waiting(self) -> int:
        """Producers waiting for room now."""
        return len(self._waiting)

    def wait(self, buffer: Waiter) -> None:
        """`buffer`'s producer starts waiting for room; past the budget, cut at once."""
        if buffer not in self._waiting:
            self._waiting[buffer] = None
            self.chars += self.per_waiter
        if self.chars > self.budget:
            self.over()

    def done_waiting(self, buffer: Waiter) -> None:
        """`buffer`'s producer stopped waiting (room came, or its wait was ended)."""
        if self._waiting.pop(buffer, False) is None:
            self.chars -= self.per_waiter

    def over(self) -> None:
        """The total passed the budget: cut the producers waiting longest until it is
        under again, or until no producer waits (the readers' output is never cut)."""
        waiting = self._waiting
        while self.chars > self.budget and waiting:
            victim = next(iter(waiting))
            del waiting[victim]
            self.chars -= self.per_waiter
            self.cuts += 1
            victim.cut()  # takes what it holds off `chars`
            if self._on_cut is not None:
                self._on_cut()
