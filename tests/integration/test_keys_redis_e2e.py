"""Two real edges (processes) sharing one real Redis: limits that hold across edges, and
the policy when Redis is gone.

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
import trio

from tests.integration.conftest import SimProcess, chat_body
from tests.integration.edgeproc import EdgeProcess, edge_process
from tests.integration.redisproc import RedisServer, redis_server

__all__ = ["redis_server"]

CHAT = "/v1/chat/completions"
SECRET = "sk-shared-7f3a9c"
STORE_DOWN = r"limits store \(redis\) unavailable"


def _toml(sim: SimProcess, redis: RedisServer, key_source: str, *, fail_open: bool = True,
          rpm: int = 10, extra: str = "") -> str:  # fmt: skip
    return (
        '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
        f'[[keys]]\nname = "shared"\n{key_source}\nrpm = {rpm}\ntpm = 1000000\n{extra}'
        f'[limits]\nredis_url = "{redis.url}"\nfail_open = {str(fail_open).lower()}\n'
        'key_prefix = "e2e:"\nredis_timeout_s = 2\n'
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
