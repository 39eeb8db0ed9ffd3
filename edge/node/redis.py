"""Redis for trio code: redis-py's asyncio client, awaited through the bridge.

The limits (`edge.limits.redisstore`) and the response store
(`edge.store.redisstore`) share this one way to talk to Redis: redis-py's
asyncio client, awaited through the edge's one trio-asyncio bridge
(`edge.node.bridge.call_asyncio`) on the asyncio loop the edge already hosts
for grpclib: no thread per call, one connection pool per client, and a trio
cancel (the request's deadline, the client leaving) cancels the Redis call
itself. No retries inside redis-py (the deadline is the caller's, and a retry
would hide an outage); every call has a deadline (`timeout_s`), and a Redis
error or a missed deadline is `RedisDown`, raised here and only here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import redis.asyncio as aioredis
import trio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from edge.node.bridge import call_asyncio


class RedisDown(Exception):
    """Redis failed, or did not answer within the deadline (the message says which)."""


class RedisLink:
    """One Redis, its calls under a deadline each."""

    __slots__ = ("client", "timeout_s")

    def __init__(self, url: str, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )

    def script(self, lua: str) -> AsyncScript:
        """A Lua script, run by EVALSHA (loaded again on NOSCRIPT by redis-py)."""
        return self.client.register_script(lua)

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` of the client (or a script), within the deadline.

        Raises:
            RedisDown: Redis answered with an error, the connection failed, or no
                answer came within `timeout_s`.
        """
        with trio.move_on_after(self.timeout_s) as deadline:
            try:
                return await call_asyncio(fn, *args, **kwargs)
            except (RedisError, OSError) as exc:
                raise RedisDown(f"{type(exc).__name__}: {exc}") from None
        assert deadline.cancelled_caught
        raise RedisDown(f"no answer within {self.timeout_s}s")

    async def aclose(self) -> None:
        """Close the connections, within the deadline; a failure to is not an error."""
        with trio.move_on_after(self.timeout_s), contextlib.suppress(RedisError, OSError):
            await call_asyncio(self.client.aclose)
