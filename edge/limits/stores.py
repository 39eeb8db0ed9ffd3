"""Which store keeps the keys' counters: Redis, the workers' shared file, or memory;
and the limiter of an edge's keys on it.

The only module that imports the stores themselves (`edge.limits.memory`,
`edge.limits.shared`, `edge.limits.redisstore`); they import none of it, so
the choice can grow without a circle. Redis's client is imported only when
Redis is configured. The workers' shared directory is given (the process
layer knows whether there is one); nothing here reads the environment.
"""

from __future__ import annotations

from pathlib import Path

from loguru import logger

from edge.config import LimitsConfig
from edge.limits.base import LimitStore
from edge.limits.limiter import KeyRing, Limiter
from edge.limits.memory import MemoryStore
from edge.limits.window import Limits
from edge.observe.metrics import EdgeMetrics

# What each store's counts hold across, for the startup line.
_SCOPE = {
    "redis": "shared by every edge using it",
    "shared": "shared by this edge's workers",
    "memory": "this process only",
}


def open_store(
    keys: list[tuple[str, Limits]],
    *,
    redis_url: str | None,
    key_prefix: str,
    timeout_s: float,
    lease_ms: int,
    shared_dir: Path | None,
) -> LimitStore:
    """The store for `keys` (name, limits): Redis, the workers' shared file (in
    `shared_dir`, the directory of this edge's workers; None: a single process), or
    memory."""
    if redis_url is not None:
        from edge.limits.redisstore import RedisStore

        return RedisStore(redis_url, prefix=key_prefix, timeout_s=timeout_s, lease_ms=lease_ms)
    if shared_dir is not None:
        from edge.limits.shared import SharedFileStore

        return SharedFileStore(shared_dir, keys, lease_ms=lease_ms)
    return MemoryStore()


def open_limiter(
    keys: KeyRing, settings: LimitsConfig, metrics: EdgeMetrics, *, shared_dir: Path | None
) -> Limiter | None:
    """The limiter of the keys with limits (None when no key has one), on their store
    (see `open_store`); the caller closes it."""
    limited = [(k.name, k.limits) for k in keys.keys if k.limited]
    if not limited:
        return None
    # A stream lease is short, renewed while its request lives (edge.limits.limiter).
    store = open_store(
        limited,
        redis_url=settings.redis_url,
        key_prefix=settings.key_prefix,
        timeout_s=settings.redis_timeout_s,
        lease_ms=int(settings.lease_s * 1000),
        shared_dir=shared_dir,
    )
    logger.info(
        "API key limits: {} key(s) with limits, counted in {} ({})",
        len(limited), store.kind, _SCOPE[store.kind],
    )  # fmt: skip
    return Limiter(
        store, fail_open=settings.fail_open, metrics=metrics, renew_s=settings.lease_renew_s
    )
