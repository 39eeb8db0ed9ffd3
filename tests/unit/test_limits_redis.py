"""The Redis store against a real redis-server: the window's logic in one Lua script,
shared by every client, and an outage reported as StoreUnavailable within the deadline."""

from __future__ import annotations

import pytest
import trio

from edge.limits.redisstore import RedisStore
from edge.limits.store import StoreUnavailable
from edge.limits.window import WINDOW_MS, Limits
from edge.node.bridge import asyncio_loop
from tests.integration.redisproc import RedisServer, redis_server

__all__ = ["redis_server"]


def _store(server: RedisServer, timeout_s: float = 2.0) -> RedisStore:
    return RedisStore(server.url, prefix="t:", timeout_s=timeout_s, lease_ms=60_000)


async def test_two_clients_share_one_window(redis_server: RedisServer) -> None:
    """rpm = 4 through two clients (two edges): the fifth request, on either, is refused,
    with the window's reset; refused requests are not counted."""
    limits = Limits(rpm=4)
    async with asyncio_loop():
        a, b = _store(redis_server), _store(redis_server)
        try:
            verdicts = [await (a if i % 2 else b).admit("k", limits, str(i)) for i in range(6)]
            assert [v.admitted for v in verdicts] == [True] * 4 + [False, False]
            assert [v.requests for v in verdicts] == [1, 2, 3, 4, 4, 4]
            assert verdicts[4].over == "requests"
            assert 0 < verdicts[4].reset_ms <= WINDOW_MS
        finally:
            await a.aclose()
            await b.aclose()


async def test_tokens_and_streams(redis_server: RedisServer) -> None:
    """Tokens counted at a run's end refuse the next request at tpm; a stream lease is held
    until released."""
    async with asyncio_loop():
        store = _store(redis_server)
        try:
            tpm = Limits(tpm=100)
            assert (await store.admit("t", tpm, "1")).admitted
            await store.add_tokens("t", 100)
            refused = await store.admit("t", tpm, "2")
            assert (refused.over, refused.tokens) == ("tokens", 100)

            streams = Limits(max_streams=2)
            assert (await store.admit("s", streams, "a")).streams == 1
            assert (await store.admit("s", streams, "b")).streams == 2
            assert (await store.admit("s", streams, "c")).over == "streams"
            await store.release("s", "a")
            assert (await store.admit("s", streams, "d")).admitted
        finally:
            await store.aclose()


async def test_an_outage_is_store_unavailable_within_the_deadline(
    redis_server: RedisServer,
) -> None:
    """Redis killed: each call raises StoreUnavailable (never hangs past its deadline)."""
    async with asyncio_loop():
        store = _store(redis_server, timeout_s=0.5)
        try:
            assert (await store.admit("k", Limits(rpm=1), "1")).admitted
            redis_server.stop()
            with trio.fail_after(5):
                for call in (
                    lambda: store.admit("k", Limits(rpm=1), "2"),
                    lambda: store.release("k", "1"),
                    lambda: store.add_tokens("k", 5),
                ):
                    with pytest.raises(StoreUnavailable):
                        await call()
        finally:
            await store.aclose()
