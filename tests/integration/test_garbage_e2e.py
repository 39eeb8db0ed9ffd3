"""A request leaves no reference cycle of the edge's own objects behind.

Whatever a request builds (its scope, run, session, filters, event buffer) must
be freed by reference counting when the request ends: objects in cycles wait for
the garbage collector, whose pauses grow with what it has to scan (the overload
curve's shed answer and the hostile mix's /healthz probes feel them). The test
serves requests through a real edge and node process, then asks the collector for
everything unreachable (kept with DEBUG_SAVEALL) and looks for the edge's types
that come with every request.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from edge.config import Config, NodeConfig, ServerConfig
from tests.integration.conftest import (
    SimProcess,
    chat_body,
    start_edge,
    start_sim,
    stop_edge,
    stop_process,
)

REQUESTS = 20
_RECORDED_BY_TESTS = frozenset(
    {"edge.run.RunInfo", "edge.stream.output.Outcome", "edge.stream.events.Usage"}
)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimProcess]:
    sim = start_sim(tmp_path, "garbage")
    yield sim
    stop_process(sim.process)


def _edge_garbage() -> Counter[str]:
    """The edge's objects among everything the collector finds unreachable now."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = Counter(
            f"{type(o).__module__}.{type(o).__qualname__}"
            for o in gc.garbage
            if type(o).__module__.startswith("edge.")
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


def _body(path: str, stream: bool) -> dict[str, object]:
    text = "no cycles please"
    if path == "/v1/responses":
        return {"model": "sim-echo", "input": text, "stream": stream}
    if path == "/v1/messages":
        return {"model": "sim-echo", "max_tokens": 64, "stream": stream,
                "messages": [{"role": "user", "content": text}]}  # fmt: skip
    return chat_body("sim-echo", text, stream=stream)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
async def test_a_finished_request_leaves_no_cycle_of_edge_objects(
    nursery: trio.Nursery, node: SimProcess, path: str, stream: bool
) -> None:
    config = Config(
        server=ServerConfig(listen="127.0.0.1:0"), nodes=(NodeConfig("sim", node.address),)
    )
    edge = await start_edge(nursery, config)
    body = _body(path, stream)
    async with httpx.AsyncClient(base_url=edge.url, timeout=20) as http:
        for _ in range(3):  # warm: what is made once per process is not per request
            assert (await http.post(path, json=body)).status_code == 200
        await edge.wait_idle()
        _edge_garbage()
        for _ in range(REQUESTS):
            assert (await http.post(path, json=body)).status_code == 200
        await edge.wait_idle()
        # An edge stopped by an earlier test may still leave its own objects (one of
        # each), and the outcomes its test recorded (RunInfo, Outcome, Usage; see
        # RunningEdge.record): what matters is nothing else that comes with every
        # request.
        per_request = {
            k: n
            for k, n in _edge_garbage().items()
            if n >= REQUESTS // 2 and k not in _RECORDED_BY_TESTS
        }
        assert per_request == {}
    await stop_edge(edge)
