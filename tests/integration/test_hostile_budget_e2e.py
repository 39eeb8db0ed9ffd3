"""End to end: the memory budget of the requests in the edge, over a real node process.

A request holds its parsed form from its parse to the end of its cycle, queued or
running; the edge charges its estimate (`edge.api.footprint`) to one budget
(`[admission] memory_budget_bytes`) before it is queued. Here the budget fits one
request of many small parts: a second one is answered 503 `overloaded` with
Retry-After while the first holds its share, and every way a request ends (answered,
streamed, its client gone mid-stream, a node error, refused after its parse) gives
its bytes back: the count and its gauge return to 0. Waits are bounded polls on
in-process state; nothing asserts a duration.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import trio

from edge.api.footprint import footprint
from edge.api.surfaces import CHAT as CHAT_API
from edge.config import AdmissionConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    edge_config,
    script,
    start_edge,
    stop_edge,
)

CHAT = "/v1/chat/completions"
WAIT_S = 20.0
# Distinct small parts: each an object of its own once parsed (~17 times its JSON).
PARTS = 8 * 1024


def _heavy(model: str, content: str, parts: int = PARTS, **extra: Any) -> dict[str, Any]:
    """A request whose last user message is `content`, after `parts` distinct small parts."""
    padding = [
        {"role": "user", "content": [{"type": f"p{i + j}"} for j in range(1024)]}
        for i in range(0, parts, 1024)
    ]
    return {
        "model": model,
        "messages": [*padding, {"role": "user", "content": content}],
        **extra,
    }


def _charge(body: dict[str, Any]) -> int:
    """What the edge charges for `body`, about: its parsed form's estimate and its bytes."""
    data = json.dumps(body).encode()
    return footprint(CHAT_API.parse(data)) + len(data)


HANG = script({"type": "delta", "delta": "x"}, {"type": "hang"})


async def _edge(nursery: trio.Nursery, sim: SimProcess, budget: int) -> RunningEdge:
    config = edge_config(sim)
    config = replace(config, admission=AdmissionConfig(memory_budget_bytes=budget))
    return await start_edge(nursery, config)


async def _poll(condition: Callable[[], bool], within_s: float = WAIT_S) -> None:
    with trio.fail_after(within_s):
        while not condition():  # noqa: ASYNC110 - in-process state with no event
            await trio.sleep(0.01)


def _gauge(edge: RunningEdge) -> float:
    value = edge.edge.metrics.registry.get_sample_value("iop_edge_request_memory_bytes")
    assert value is not None
    return value


async def _given_back(edge: RunningEdge) -> None:
    """Every request's bytes are back: the budget's count and its gauge say 0."""
    admission = edge.edge.chat.admission
    await _poll(lambda: admission.held == 0)
    assert _gauge(edge) == 0


async def _hold(http: httpx.AsyncClient, body: dict[str, Any], started: trio.Event) -> None:
    """A stream mid-answer that holds its bytes until its client leaves (cancelled)."""
    async with http.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if '"content":"x"' in line:
                started.set()
                await trio.sleep_forever()


async def test_a_full_budget_answers_503_overloaded_and_serves_once_given_back(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """While a request of many small parts holds most of the budget, another one is
    answered 503 overloaded with Retry-After and a message naming the budget, and a
    small request is still served; once the first one's client leaves mid-stream its
    bytes are back (gauge 0) and the same heavy request is answered."""
    heavy = _heavy("sim-echo", "after")
    holder = _heavy("sim-script", HANG, stream=True)
    charge = _charge(holder)
    edge = await _edge(nursery, sim, budget=charge + _charge(heavy) // 2)
    admission = edge.edge.chat.admission
    started = trio.Event()
    async with (
        httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http,
        trio.open_nursery() as holders,
    ):
        holders.start_soon(_hold, http, holder, started)
        with trio.fail_after(WAIT_S):
            await started.wait()
        assert admission.held > charge * 0.9  # (httpx writes JSON a little tighter)
        assert _gauge(edge) == admission.held

        refused = await http.post(CHAT, json=heavy)
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("overloaded", "overloaded")
        assert "memory budget" in error["message"]
        assert "retry after" in error["message"]
        shed = edge.edge.metrics.registry.get_sample_value(
            "iop_edge_shed_total", {"reason": "memory_budget"}
        )
        assert shed == 1

        small = await http.post(
            CHAT, json={"model": "sim-echo", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert small.status_code == 200
        holders.cancel_scope.cancel()  # the holder's client leaves mid-stream
    await edge.wait_idle()
    await _given_back(edge)
    async with httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http:
        answer = await http.post(CHAT, json=heavy)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == "after"
    await _given_back(edge)
    await stop_edge(edge)


async def test_every_way_a_request_ends_gives_its_bytes_back(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """Answered whole, streamed, a node error before and after the first byte, an unknown
    model (refused after the parse), a request larger than the whole budget (413): after
    each the budget holds nothing and its gauge says 0."""
    edge = await _edge(nursery, sim, budget=2 * _charge(_heavy("sim-echo", "x")))
    error = script({"type": "error", "error": "GPU on fire"})
    late_error = script({"type": "delta", "delta": "x"}, {"type": "error", "error": "later"})
    async with httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http:
        answer = await http.post(CHAT, json=_heavy("sim-echo", "whole"))
        assert answer.status_code == 200
        await _given_back(edge)

        async with http.stream(
            "POST", CHAT, json=_heavy("sim-echo", "streamed", stream=True)
        ) as response:
            assert response.status_code == 200
            assert (await response.aread()).endswith(b"data: [DONE]\n\n")
        await _given_back(edge)

        failed = await http.post(CHAT, json=_heavy("sim-script", error))
        assert failed.status_code == 502
        await _given_back(edge)

        async with http.stream(
            "POST", CHAT, json=_heavy("sim-script", late_error, stream=True)
        ) as response:
            assert b'"type":"run_error"' in await response.aread()
        await _given_back(edge)

        unknown = await http.post(CHAT, json=_heavy("no-such-model", "x"))
        assert unknown.status_code == 404
        await _given_back(edge)

        too_big = await http.post(CHAT, json=_heavy("sim-echo", "x", parts=3 * PARTS))
        assert too_big.status_code == 413, too_big.text
        assert "more than the edge's whole budget" in too_big.json()["error"]["message"]
        await _given_back(edge)
    await edge.wait_idle()
    await stop_edge(edge)
