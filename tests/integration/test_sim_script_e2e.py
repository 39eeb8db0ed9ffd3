"""End to end: a sim-script whose numbers are hostile is refused, and the node serves on.

`{"sleep_ms": NaN}` once reached asyncio's timers: a standalone `iop-sim-node`
lost its timers until restart, an embedded node (on the loop the edge hosts)
raised an AssertionError inside the edge. Here each hostile pause goes through
a real edge to a real node, the `iop-sim-node` process and an embedded one: the
answer is the node's clear refusal (a 400), and the next script, which sleeps,
completes (the node's timers still work).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from edge.config import Config, NodeConfig, ServerConfig
from tests.integration.conftest import chat_body, start_edge, stop_edge

CHAT = "/v1/chat/completions"
# As the script's JSON text says them: NaN and Infinity are what Python's json writes.
HOSTILE_PAUSES = ['"nan"', "NaN", "Infinity", "-Infinity", "1e308", "-5", "true"]
SLEEPY = json.dumps(
    {
        "events": [
            {"sleep_ms": 30},
            {"type": "delta", "delta": "still ticking"},
            {"type": "complete"},
        ]
    }
)


def _hostile(pause: str, key: str) -> str:
    item = f'{{"{key}": {pause}}}'
    return f'{{"events": [{item}, {{"type": "delta", "delta": "x"}}, {{"type": "complete"}}]}}'


async def _serves_on(http: httpx.AsyncClient) -> None:
    """A script that sleeps still completes: the node's timers work."""
    ok = await http.post(CHAT, json=chat_body("sim-script", SLEEPY))
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"] == "still ticking"


async def _refused(http: httpx.AsyncClient, script: str, key: str) -> None:
    """Streamed or not (the error comes before any output): the node's refusal, a 400
    naming the item and the bound (the request's fault)."""
    for stream in (False, True):
        answer = await http.post(CHAT, json=chat_body("sim-script", script, stream=stream))
        assert answer.status_code == 400, answer.text
        error: dict[str, Any] = answer.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_script")
        assert f"events[0].{key} must be a number from 0 to 600000" in error["message"]


async def _check_node(http: httpx.AsyncClient) -> None:
    await _serves_on(http)
    for pause in HOSTILE_PAUSES:
        for key in ("sleep_ms", "accept_after_ms"):
            await _refused(http, _hostile(pause, key), key)
            # A success between the refusals: the node's breaker counts errors in a row.
            await _serves_on(http)


async def test_hostile_pauses_on_the_sim_process(http: httpx.AsyncClient) -> None:
    """sleep_ms / accept_after_ms of "nan", NaN, Infinity, 1e308, negative or a bool: each
    is a refusal naming the bound, and the `iop-sim-node` process keeps serving
    scripts that sleep."""
    await _check_node(http)


@pytest.fixture
async def embedded_http(nursery: trio.Nursery) -> Any:
    config = Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
        nodes=(NodeConfig("embedded", "embedded"),),
    )
    running = await start_edge(nursery, config)
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
        yield client
    await stop_edge(running)


async def test_hostile_pauses_on_an_embedded_node(embedded_http: httpx.AsyncClient) -> None:
    """The same on a node embedded in the edge (its loop is the edge's): a refusal,
    no exception in the edge, and the node keeps serving scripts that sleep."""
    await _check_node(embedded_http)
