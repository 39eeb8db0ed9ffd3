"""The Redis store against a real redis-server: the window's logic in one Lua script,
shared by every client, an outage reported as StoreUnavailable within the deadline,
stream leases that expire unless renewed, and a release lost to a blip retried."""

from __future__ import annotations

import pytest
import redis
import trio

from edge.limits.base import StoreUnavailable
from edge.limits.limiter import Gate, Key, Limiter
from edge.limits.redisstore import RedisStore
from edge.limits.window import WINDOW_MS, Limits
from edge.node.bridge import asyncio_loop
from edge.observe.metrics import EdgeMetrics
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


def _redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _until_redis_ms(client: redis.Redis, at_ms: int) -> None:
    """Until Redis's own clock (the one leases are scored on) reaches `at_ms`."""
    with trio.fail_after(30):
        while await trio.to_thread.run_sync(_redis_ms, client) < at_ms:  # noqa: ASYNC110 - another process's clock
            await trio.sleep(0.05)


async def test_a_lease_expires_unless_renewed(redis_server: RedisServer) -> None:
    """A stream lease lasts lease_ms from its last renewal: renewed, it outlives several
    leases (and a second stream over max_streams is refused); not renewed, it is given
    back once its lease is over."""
    client = redis_server.client()
    limits = Limits(max_streams=1)
    async with asyncio_loop():
        store = RedisStore(redis_server.url, prefix="t:", timeout_s=2.0, lease_ms=400)
        try:
            assert (await store.admit("k", limits, "live")).admitted
            first = client.zscore("t:s:k", "live")
            assert first is not None
            while (now := await trio.to_thread.run_sync(_redis_ms, client)) < first + 3 * 400:
                await store.renew({"k": {"live"}})
                await trio.sleep(0.1)
            assert (client.zscore("t:s:k", "live") or 0) > now
            assert (await store.admit("k", limits, "second")).over == "streams"
            last = client.zscore("t:s:k", "live")
            assert last is not None
            await _until_redis_ms(client, int(last) + 1)
            assert (await store.admit("k", limits, "after")).admitted
        finally:
            await store.aclose()
            client.close()


async def test_a_renewal_is_one_call_for_every_key_and_lease(redis_server: RedisServer) -> None:
    """The leases of three keys (30 in all) are renewed by one script call."""
    client = redis_server.client()
    async with asyncio_loop():
        store = _store(redis_server)
        try:
            leases = {f"k{i}": {f"{i}-{j}" for j in range(10)} for i in range(3)}
            for key, held in leases.items():
                for lease in held:
                    assert (await store.admit(key, Limits(max_streams=10), lease)).admitted
            await store.renew(leases)  # the first one loads the script (NOSCRIPT, LOAD)
            before = client.info("commandstats")["cmdstat_evalsha"]["calls"]
            await store.renew(leases)
            after = client.info("commandstats")["cmdstat_evalsha"]["calls"]
            assert after - before == 1
            now = _redis_ms(client)
            for key, held in leases.items():
                assert client.zcount(f"t:s:{key}", now + 50_000, "+inf") == len(held)
        finally:
            await store.aclose()
            client.close()


async def test_a_refund_takes_back_the_request_and_its_stream(redis_server: RedisServer) -> None:
    """A refunded admission is counted neither in the window nor in the streams."""
    limits = Limits(rpm=2, max_streams=1)
    async with asyncio_loop():
        store = _store(redis_server)
        try:
            assert (await store.admit("k", limits, "a")).requests == 1
            await store.refund("k", "a")
            again = await store.admit("k", limits, "b")
            assert (again.admitted, again.requests, again.streams) == (True, 1, 1)
        finally:
            await store.aclose()


def _store_errors(limiter: Limiter) -> float:
    sample = limiter.metrics.registry.get_sample_value(
        "iop_edge_limits_store_errors_total", {"store": "redis"}
    )
    return sample or 0.0


async def test_a_release_during_a_redis_blip_is_retried_once_it_is_back(
    redis_server: RedisServer,
) -> None:
    """Redis paused while a request ends: its end returns within its bound (the release
    fails), and once Redis answers again the retrier gives the stream back, long before
    its lease (60 s) would have."""
    client = redis_server.client()
    limits = Limits(max_streams=1)
    key = Key("k", limits)
    async with asyncio_loop():
        store = RedisStore(redis_server.url, prefix="t:", timeout_s=0.2, lease_ms=60_000)
        limiter = Limiter(store, fail_open=True, metrics=EdgeMetrics())
        try:
            gate = Gate(limiter, limiter.metrics)
            gate.key = key
            await gate.admit()
            assert client.zcard("t:s:k") == 1
            redis_server.pause()
            try:
                with trio.fail_after(5):
                    await gate.end(None)
                with trio.fail_after(10):
                    while _store_errors(limiter) < 2:  # noqa: ASYNC110 - the release, then a retry, failed
                        await trio.sleep(0.02)
            finally:
                redis_server.resume()
            with trio.fail_after(30):
                while await trio.to_thread.run_sync(client.zcard, "t:s:k"):  # noqa: ASYNC110 - Redis's state
                    await trio.sleep(0.05)
            assert (await store.admit("k", limits, "next")).admitted
        finally:
            await limiter.aclose()
            client.close()
