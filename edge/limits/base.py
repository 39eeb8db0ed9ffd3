"""What every store of a key's counters is: the `LimitStore` protocol, its one error, its clock.

A store runs `edge.limits.window`'s logic on state it keeps: `MemoryStore`
in this process (`edge.limits.memory`), `SharedFileStore` in a file every
worker of one edge maps (`edge.limits.shared`), `RedisStore` in Redis for
every edge that uses it (`edge.limits.redisstore`). A store that cannot
answer raises `StoreUnavailable`, and nothing else; the limiter decides what
that means.

Imports only `edge.limits.window`: every store and the limiter import this,
and it knows none of them (`edge.limits.stores` picks one).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Protocol

from edge.limits.window import Decision, Limits


class StoreUnavailable(Exception):
    """The store did not answer, or not in time: the limiter applies `fail_open`."""


def monotonic_ms() -> int:
    """Milliseconds on CLOCK_MONOTONIC: one clock for every process of the machine."""
    return time.monotonic_ns() // 1_000_000


class LimitStore(Protocol):
    """The counters of every limited key, by key name."""

    # "memory" | "shared" | "redis": the metric label and the log's word for it.
    kind: str

    async def admit(self, key: str, limits: Limits, lease: str) -> Decision:
        """Count one request of `key` if its limits allow it; `lease` names its stream."""
        ...

    async def release(self, key: str, lease: str) -> None:
        """The stream `lease` of `key` is over (called once per admitted request)."""
        ...

    async def refund(self, key: str, lease: str) -> None:
        """Take back an admitted request of `key` (not counted after all) and its stream."""
        ...

    async def renew(self, leases: Mapping[str, Collection[str]]) -> None:
        """The streams this process holds, by key (every key it held one of since the last
        renewal, empty when none is left): each stays held another lease period; any
        other this process counted (a release that failed) is left to expire."""
        ...

    async def add_tokens(self, key: str, tokens: int) -> None:
        """Count a run's tokens against `key`."""
        ...

    def rekey(self, keys: list[tuple[str, Limits]]) -> None:
        """The limited keys are now `keys` (name, limits), after a reload: a key's counts
        carry over while its name stays; a key that left is not counted any more (a call
        for it does nothing)."""
        ...

    async def aclose(self) -> None: ...
