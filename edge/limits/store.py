"""Where a key's counters live: the `LimitStore` protocol, and the in-process store.

A store runs `edge.limits.window`'s logic on state it keeps: `MemoryStore`
in this process (one worker), `SharedFileStore` in a file every worker of
one edge maps (`edge.limits.shared`), `RedisStore` in Redis for every edge
that uses it (`edge.limits.redisstore`). A store that cannot answer raises
`StoreUnavailable`, and nothing else; the limiter decides what that means.

`open_store` picks one: Redis when configured, else the shared file when
the edge runs several workers (`IOP_EDGE_SHARED_DIR`, set by the
supervisor), else memory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Protocol

from edge.limits.window import Decision, Limits, Window, add_tokens, admit, refund

# Set by the supervisor of several workers: a directory private to one edge run.
SHARED_DIR_ENV = "IOP_EDGE_SHARED_DIR"


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

    async def aclose(self) -> None: ...


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

    async def aclose(self) -> None:
        pass


def open_store(
    keys: list[tuple[str, Limits]],
    *,
    redis_url: str | None,
    key_prefix: str,
    timeout_s: float,
    lease_ms: int,
) -> LimitStore:
    """The store for `keys` (name, limits): Redis, the workers' shared file, or memory."""
    if redis_url is not None:
        from edge.limits.redisstore import RedisStore

        return RedisStore(redis_url, prefix=key_prefix, timeout_s=timeout_s, lease_ms=lease_ms)
    shared_dir = os.environ.get(SHARED_DIR_ENV)
    if shared_dir:
        from edge.limits.shared import SharedFileStore

        return SharedFileStore(Path(shared_dir), keys, lease_ms=lease_ms)
    return MemoryStore()
