"""The counters in this process: the store of a single-process edge without Redis.

Runs `edge.limits.window` on a dict; knows nothing of the other stores, nor
of which one an edge uses (`edge.limits.stores`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from edge.limits.base import monotonic_ms
from edge.limits.window import Decision, Limits, Window, add_tokens, admit, refund


class MemoryStore:
    """The counters in this process: exact for one worker, per worker for several."""

    kind = "memory"

    def __init__(self, clock: Callable[[], int] = monotonic_ms) -> None:
        self._clock = clock
        self._windows: dict[str, Window] = {}
        self._streams: dict[str, set[str]] = {}

    async def admit(self, key: str, limits: Limits, lease: str) -> Decision:
        window = self._windows.setdefault(key, Window())
        held = self._streams.setdefault(key, set())
        decision = admit(window, len(held), limits, self._clock())
        if decision.admitted and limits.max_streams is not None:
            held.add(lease)
        return decision

    async def release(self, key: str, lease: str) -> None:
        self._streams.get(key, set()).discard(lease)

    async def refund(self, key: str, lease: str) -> None:
        refund(self._windows.setdefault(key, Window()), self._clock())
        await self.release(key, lease)

    async def renew(self, leases: Mapping[str, Collection[str]]) -> None:
        pass  # in this process: a release cannot fail, nothing to expire

    async def add_tokens(self, key: str, tokens: int) -> None:
        add_tokens(self._windows.setdefault(key, Window()), tokens, self._clock())

    def rekey(self, keys: list[tuple[str, Limits]]) -> None:
        pass  # counted by name: a new key starts empty, one that left is not asked for

    async def aclose(self) -> None:
        pass
