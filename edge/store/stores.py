"""Which store keeps the responses: SQLite (the default), Redis, or none.

The only module that imports the stores themselves (`edge.store.sqlite`,
`edge.store.redisstore`); Redis's client is imported only when Redis is configured.
The directory of the SQLite file, when `[responses] path` is unset, is given (the
process layer knows systemd's state directory and the edge run's own); nothing here
reads the environment.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from loguru import logger

from edge.config import Config
from edge.store.base import Bounds, ResponseStore

SQLITE_FILE = "responses.sqlite3"


async def open_response_store(config: Config, directory: Path) -> ResponseStore | None:
    """The store `[responses]` names (None: `store = "off"`), its SQLite file in `directory`
    unless `path` is set; the caller closes it.

    Raises:
        OSError, sqlite3.Error: the SQLite file cannot be opened (the edge does not start).
    """
    settings = config.responses
    bounds = Bounds(
        settings.max_responses, settings.max_bytes, settings.max_response_bytes, settings.ttl_s,
        owner_max_responses=settings.key_max_responses, owner_max_bytes=settings.key_max_bytes,
    )  # fmt: skip
    where: str
    store: ResponseStore
    if settings.store == "off":
        logger.info("responses store: off (previous_response_id and item_reference are refused)")
        return None
    if settings.store == "redis":
        from edge.store.redisstore import RedisStore

        url = settings.redis_url or config.limits.redis_url
        assert url is not None  # the config's parse made sure
        store = RedisStore(
            url, bounds, prefix=settings.key_prefix, timeout_s=settings.redis_timeout_s
        )
        where = "redis (shared by every edge using it)"
    else:
        from edge.store.sqlite import SqliteStore

        path = Path(settings.path) if settings.path is not None else directory / SQLITE_FILE
        try:
            store = await SqliteStore.open(path, bounds)
        except sqlite3.Error as exc:  # its message does not name the file
            raise sqlite3.OperationalError(f"{path}: {exc}") from None
        where = f"sqlite {path}"
    logger.info(
        "responses store: {}; at most {} responses, {} bytes, {}s each; per key {} responses,"
        " {} bytes", where, bounds.max_responses, bounds.max_bytes, bounds.ttl_s,
        *bounds.of("a key")[:2],
    )  # fmt: skip
    return store
