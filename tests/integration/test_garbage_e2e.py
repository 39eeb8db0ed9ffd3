"""A request leaves no reference cycle of the edge's own objects behind.

Whatever a request builds (its scope, run, session, filters, event buffer) must
be freed by reference counting when the request ends: objects in cycles wait for
the garbage collector, whose pauses grow with what it has to scan (the overload
curve's shed answer and the hostile mix's /healthz probes feel them). The test
serves requests through a real edge and node process with the collector off, and
counts the edge's objects that outlived them.
"""

from __future__ import annotations

import gc
from collections import Counter

import httpx
import pytest

from tests.integration.conftest import RunningEdge, chat_body

REQUESTS = 20


def _edge_objects() -> Counter[str]:
    """The edge's objects alive now (those the collector tracks), by type."""
    found: Counter[str] = Counter()
    for o in gc.get_objects():
        module = type(o).__module__
        if isinstance(module, str) and module.startswith("edge."):
            found[f"{module}.{type(o).__qualname__}"] += 1
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
    edge: RunningEdge, path: str, stream: bool
) -> None:
    body = _body(path, stream)
    async with httpx.AsyncClient(base_url=edge.url, timeout=20) as http:
        for _ in range(3):  # warm: what is made once per process is not per request
            assert (await http.post(path, json=body)).status_code == 200
        await edge.wait_idle()
        # With the collector off, what reference counting does not free stays: the
        # edge's objects that outlive the window's requests are counted whatever
        # earlier tests left behind (they were there before the window too).
        gc.collect()
        gc.disable()
        try:
            before = _edge_objects()
            for _ in range(REQUESTS):
                assert (await http.post(path, json=body)).status_code == 200
            await edge.wait_idle()
            after = _edge_objects()
        finally:
            gc.enable()
        # The test's own recorder keeps each run's info and outcome (RunningEdge.record).
        kept: Counter[str] = Counter()
        for info, outcome in edge.outcomes[-REQUESTS:]:
            for o in (info, outcome, outcome.usage):
                kept[f"{type(o).__module__}.{type(o).__qualname__}"] += o is not None
        grown = after - before - kept
        per_request = {k: n for k, n in grown.items() if n >= REQUESTS // 2}
        assert per_request == {}, per_request
