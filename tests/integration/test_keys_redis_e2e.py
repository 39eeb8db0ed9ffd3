"""Two real edges (processes) sharing one real Redis: limits that hold across edges, the
policy when Redis is gone, and stream leases (short, renewed) across a Redis blip.

rpm = 10 on a key both edges know (one reads it from the environment, the other from a
file): ten requests spread over both pass, the 11th, on either, is 429. Redis killed:
`fail_open = true` lets requests in, `false` answers 503; each edge says so in one log
line and counts it. No edge ever writes a key's secret to its log.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest
import redis
import trio

from tests.integration.conftest import SimProcess, chat_body, script
from tests.integration.edgeproc import EdgeProcess, edge_process
from tests.integration.redisproc import RedisServer, redis_server

__all__ = ["redis_server"]

CHAT = "/v1/chat/completions"
SECRET = "sk-shared-7f3a9c"
STORE_DOWN = r"limits store \(redis\) unavailable"


def _toml(sim: SimProcess, redis: RedisServer, key_source: str, *, fail_open: bool = True,
          rpm: int = 10, extra: str = "",
          limits: str = "redis_timeout_s = 2\n") -> str:  # fmt: skip
    return (
        '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
        f'[[keys]]\nname = "shared"\n{key_source}\nrpm = {rpm}\ntpm = 1000000\n{extra}'
        f'[limits]\nredis_url = "{redis.url}"\nfail_open = {str(fail_open).lower()}\n'
        f'key_prefix = "e2e:"\n{limits}'
    )


@asynccontextmanager
async def _two_edges(
    tmp_path: Path, sim: SimProcess, redis: RedisServer, **kw: object
) -> AsyncIterator[tuple[EdgeProcess, EdgeProcess]]:
    (tmp_path / "shared.key").write_text(SECRET + "\n")
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(edge_process(
            tmp_path, _toml(sim, redis, 'key_env = "IOP_TEST_SHARED_KEY"', **kw),  # type: ignore[arg-type]
            env={"IOP_TEST_SHARED_KEY": SECRET}, name="edge-a",
        ))  # fmt: skip
        b = await stack.enter_async_context(edge_process(
            tmp_path, _toml(sim, redis, 'key_file = "shared.key"', **kw),  # type: ignore[arg-type]
            name="edge-b",
        ))  # fmt: skip
        yield a, b


def _headers(secret: str = SECRET) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def _chat(http: httpx.AsyncClient, edge: EdgeProcess) -> httpx.Response:
    """One small chat request with the shared key."""
    return await http.post(edge.url + CHAT, json=chat_body("sim-echo", "hi"), headers=_headers())


def _store_errors(metrics: str) -> float:
    prefix = 'iop_edge_limits_store_errors_total{store="redis"}'
    return float(next(x for x in metrics.splitlines() if x.startswith(prefix)).split()[-1])


async def test_the_11th_request_on_either_edge_is_429(
    tmp_path: Path, sim: SimProcess, redis_server: RedisServer
) -> None:
    """rpm = 10 shared through Redis: ten requests alternating over two edges pass with the
    requests remaining counting down across both; the 11th is 429 on each edge (the SDK's
    RateLimitError on one), with Retry-After and the headers; no secret is ever logged."""
    async with _two_edges(tmp_path, sim, redis_server) as (a, b):
        async with httpx.AsyncClient(timeout=30) as http:
            remaining = []
            for i in range(10):
                edge = (a, b)[i % 2]
                answer = await _chat(http, edge)
                assert answer.status_code == 200, answer.text
                remaining.append(int(answer.headers["x-ratelimit-remaining-requests"]))
                assert answer.headers["x-ratelimit-limit-tokens"] == "1000000"
            assert remaining == list(range(9, -1, -1))
            refused = await _chat(http, b)
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert (error["type"], error["code"], error["param"]) == (
                "rate_limit_exceeded", "rate_limit_exceeded", None,
            )  # fmt: skip
            reset = refused.headers["x-ratelimit-reset-requests"]
            assert reset.endswith("s")
            assert 1 <= int(refused.headers["Retry-After"]) <= 60
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
            assert refused.headers["x-ratelimit-limit-requests"] == "10"

        def over_on_a() -> openai.RateLimitError:
            sdk = openai.OpenAI(base_url=a.url + "/v1", api_key=SECRET, max_retries=0)
            with sdk, pytest.raises(openai.RateLimitError) as info:
                sdk.chat.completions.create(
                    model="sim-echo", messages=[{"role": "user", "content": "hi"}]
                )
            return info.value

        error_a = await trio.to_thread.run_sync(over_on_a)
        assert error_a.response.headers["x-ratelimit-remaining-requests"] == "0"
        for edge in (a, b):
            await edge.wait_line("API key limits: 1 key.* counted in redis")
            assert SECRET not in edge.stderr


async def test_redis_down_fail_open_lets_in_and_fail_closed_refuses(
    tmp_path: Path, sim: SimProcess, redis_server: RedisServer
) -> None:
    """Redis killed: the fail_open edge answers 200 (without rate-limit headers), the
    fail_closed one 503 limits_unavailable; each logs one line saying so and counts the
    failures in iop_edge_limits_store_errors_total."""
    (tmp_path / "shared.key").write_text(SECRET + "\n")
    async with AsyncExitStack() as stack:
        open_edge = await stack.enter_async_context(edge_process(
            tmp_path, _toml(sim, redis_server, 'key_file = "shared.key"'), name="open",
        ))  # fmt: skip
        closed_edge = await stack.enter_async_context(edge_process(
            tmp_path, _toml(sim, redis_server, 'key_file = "shared.key"', fail_open=False),
            name="closed",
        ))  # fmt: skip
        async with httpx.AsyncClient(timeout=30) as http:
            for edge in (open_edge, closed_edge):
                ok = await _chat(http, edge)
                assert ok.status_code == 200
            redis_server.stop()
            for _ in range(3):
                let_in = await _chat(http, open_edge)
                assert let_in.status_code == 200, let_in.text
                assert "x-ratelimit-remaining-requests" not in let_in.headers
                refused = await _chat(http, closed_edge)
                assert refused.status_code == 503
                error = refused.json()["error"]
                assert (error["type"], error["code"]) == (
                    "service_unavailable",
                    "limits_unavailable",
                )
            await open_edge.wait_line(STORE_DOWN + r".*letting requests in \(fail_open\)")
            await closed_edge.wait_line(STORE_DOWN + ".*answering 503")
            for edge in (open_edge, closed_edge):
                # Rate-limited: far fewer lines than failures (one per 10 s, admit and end alike).
                logged = [x for x in edge.lines if "limits store (redis) unavailable" in x]
                metrics = (await http.get(edge.url + "/metrics")).text
                assert 1 <= len(logged) < _store_errors(metrics)
                assert _store_errors(metrics) >= 3
                assert SECRET not in edge.stderr


# Short leases, so that a test spans several of them: renewed every 0.3 s, 1 s long.
_SHORT_LEASES = "redis_timeout_s = 0.2\nlease_s = 1\nlease_renew_s = 0.3\n"
_HOLD = chat_body("sim-script", script({"type": "delta", "delta": "x"}, {"type": "hang"}),
                  stream=True)  # fmt: skip


def _live_leases(client: redis.Redis) -> int:
    """The key's streams in flight as Redis counts them: leases not expired yet."""
    seconds, micros = client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    return int(client.zcount("e2e:s:shared", f"({now}", "+inf"))


async def _hold(http: httpx.AsyncClient, edge: EdgeProcess, holding: trio.Event) -> None:
    """A stream mid-answer that stays open until cancelled (its client leaves)."""
    async with http.stream("POST", edge.url + CHAT, json=_HOLD, headers=_headers()) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if '"content":"x"' in line:
                holding.set()
                await trio.sleep_forever()


def _metric(metrics: str, prefix: str) -> float:
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(prefix))


@asynccontextmanager
async def _one_stream_held(
    tmp_path: Path, sim: SimProcess, redis_server: RedisServer
) -> AsyncIterator[tuple[EdgeProcess, httpx.AsyncClient, redis.Redis, trio.CancelScope]]:
    """An edge whose key has max_streams = 1 and short leases, with that one stream held
    open by a client: (the edge, an HTTP client, a Redis client, the holder's scope, whose
    cancel makes the client leave)."""
    (tmp_path / "shared.key").write_text(SECRET + "\n")
    toml = _toml(sim, redis_server, 'key_file = "shared.key"', rpm=1000,
                 extra="max_streams = 1\n", limits=_SHORT_LEASES)  # fmt: skip
    client = redis_server.client()
    try:
        async with (
            edge_process(tmp_path, toml, name="edge") as edge,
            httpx.AsyncClient(timeout=30) as http,
            trio.open_nursery() as nursery,
        ):
            holding = trio.Event()
            holder = trio.CancelScope()

            async def hold() -> None:
                with holder:
                    await _hold(http, edge, holding)

            nursery.start_soon(hold)
            await holding.wait()
            yield edge, http, client, holder
    finally:
        client.close()


async def test_a_stream_outliving_many_leases_keeps_its_stream(
    tmp_path: Path, sim: SimProcess, redis_server: RedisServer
) -> None:
    """max_streams = 1, leases of 1 s renewed every 0.3 s: a stream that lives for several
    leases is still counted (a second request is 429 in flight) until it ends; then
    the key's streams are 0 and a request passes."""
    async with _one_stream_held(tmp_path, sim, redis_server) as (edge, http, client, holder):
        ((lease, first),) = client.zrange("e2e:s:shared", 0, -1, withscores=True)
        with trio.fail_after(30):  # Redis's clock passes three leases' ends
            while (await trio.to_thread.run_sync(client.time))[0] * 1000 < first + 3000:  # noqa: ASYNC110 - another process's clock
                await trio.sleep(0.1)
        assert await trio.to_thread.run_sync(_live_leases, client) == 1
        assert (client.zscore("e2e:s:shared", lease) or 0) > first + 2000  # renewed since
        refused = await _chat(http, edge)
        assert refused.status_code == 429
        assert "in flight" in refused.json()["error"]["message"]
        holder.cancel()
        with trio.fail_after(30):
            while await trio.to_thread.run_sync(_live_leases, client):  # noqa: ASYNC110 - Redis's state
                await trio.sleep(0.05)
        assert (await _chat(http, edge)).status_code == 200


async def test_a_redis_blip_during_a_release_does_not_leak_the_stream(
    tmp_path: Path, sim: SimProcess, redis_server: RedisServer
) -> None:
    """Redis paused while the key's one stream ends: the release fails (and so do its
    first retries); once Redis is back, the key's streams return to 0 within a few lease
    periods (retried, or expired), and the key's next request passes, not 429."""
    async with _one_stream_held(tmp_path, sim, redis_server) as (edge, http, client, holder):
        assert await trio.to_thread.run_sync(_live_leases, client) == 1
        gauge = 'iop_edge_key_streams{key="shared"}'
        errors = "iop_edge_limits_store_errors_total"
        redis_server.pause()
        try:
            holder.cancel()  # the client leaves: the edge ends the stream, Redis is away
            with trio.fail_after(20):
                metrics = (await http.get(edge.url + "/metrics")).text
                while _metric(metrics, gauge) != 0:
                    await trio.sleep(0.02)
                    metrics = (await http.get(edge.url + "/metrics")).text
                ended_at = _metric(metrics, errors)
                while _metric(metrics, errors) < ended_at + 2:  # the release, or a retry, failed
                    await trio.sleep(0.02)
                    metrics = (await http.get(edge.url + "/metrics")).text
            await edge.wait_line(STORE_DOWN)
        finally:
            redis_server.resume()
        with trio.fail_after(20):  # a few lease periods (1 s each), generously
            while await trio.to_thread.run_sync(_live_leases, client):  # noqa: ASYNC110 - Redis's state
                await trio.sleep(0.05)
        passed = await _chat(http, edge)
        assert passed.status_code == 200, passed.text
