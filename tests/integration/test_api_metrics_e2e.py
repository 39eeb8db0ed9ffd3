"""Requests and tokens are counted by the API they came in by (`api` label)."""

from __future__ import annotations

import httpx
import trio

from tests.integration.conftest import RunningEdge, chat_body


async def test_each_api_is_counted_under_its_own_label(edge: RunningEdge) -> None:
    text = "count me by api"
    bodies = {
        "/v1/chat/completions": chat_body("sim-echo", text),
        "/v1/responses": {"model": "sim-echo", "input": text, "stream": True},
        "/v1/messages": {"model": "sim-echo", "max_tokens": 64,
                         "messages": [{"role": "user", "content": text}]},
    }  # fmt: skip
    async with httpx.AsyncClient(base_url=edge.url, timeout=20) as http:
        for path, body in bodies.items():
            assert (await http.post(path, json=body)).status_code == 200
        bad = await http.post("/v1/messages", json={"model": "sim-echo", "messages": []})
        assert bad.status_code == 400
    await edge.wait_idle()
    requests = "iop_edge_requests_total"
    # A request is counted once its cycle is over, just after its last byte went out.
    with trio.fail_after(10):
        while edge.counted(requests) < 4:  # noqa: ASYNC110 - in-process state with no event
            await trio.sleep(0.01)
    assert edge.counted(requests, api="chat", status="success", stream="false") == 1
    assert edge.counted(requests, api="responses", status="success", stream="true") == 1
    assert edge.counted(requests, api="messages", status="success") == 1
    assert edge.counted(requests, api="messages", status="error") == 1
    assert edge.counted(requests) == 4
    for api in ("chat", "responses", "messages"):
        assert edge.counted("iop_edge_tokens_total", api=api, type="output") > 0
