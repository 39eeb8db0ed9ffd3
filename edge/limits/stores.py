"""Which store keeps the keys' counters: Redis, the workers' shared file, or memory.

The only module that imports the stores themselves (`edge.limits.memory`,
`edge.limits.shared`, `edge.limits.redisstore`); they import none of it, so
the choice can grow without a circle. Redis's client is imported only when
Redis is configured.
"""

from __future__ import annotations

import os
from pathlib import Path

from edge.limits.base import LimitStore
from edge.limits.memory import MemoryStore
from edge.limits.window import Limits

# Set by the supervisor of several workers: a directory private to one edge run.
SHARED_DIR_ENV = "IOP_EDGE_SHARED_DIR"


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
