"""End to end, through a real edge to an `iop-sim-node` process: what a small Responses
body may make the edge build from stored items, and the admission of every endpoint
that reads a body or stored items.

A stored ~2 MB answer referred to 300 or 3,000 times by a body of a few KiB is a 413
naming the limit, reckoned from the item's size before anything is expanded: the
edge's memory (traced in its process) stays a few MiB above what it was, and it keeps
serving (one reference to the same item still works). `count_tokens`, a stored
response and its input items count against the key's `rpm` as chat requests do, and
a key over it gets its 429 from its headers, its body never parsed.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import h11
import httpx
import pytest
import trio

from edge.config import KeyConfig
from edge.contract.routes import MAX_MESSAGE_BYTES
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    edge_config,
    script,
    start_edge,
    stop_edge,
)
from tests.integration.rawhttp import read_response

MiB = 1 << 20
RESPONSES = "/v1/responses"
COUNT = "/v1/messages/count_tokens"
BIG_CHARS = 2_000_000
KEYS = (KeyConfig("team-a", "sk-team-a", rpm=3), KeyConfig("free", "sk-free"))


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def _store_big_answer(http: httpx.AsyncClient, **kw: Any) -> tuple[str, str]:
    """A stored response whose message is ~2 MB: its id and its message's id."""
    big = script({"type": "delta", "delta": "x", "delta_times": BIG_CHARS}, {"type": "complete"})
    stored = await http.post(RESPONSES, json={"model": "sim-script", "input": big}, **kw)
    assert stored.status_code == 200, stored.text
    answer = stored.json()
    (message,) = [item for item in answer["output"] if item["type"] == "message"]
    assert len(message["content"][0]["text"]) == BIG_CHARS
    return answer["id"], message["id"]


def _referring(item_id: str, count: int) -> dict[str, Any]:
    refs = [{"type": "item_reference", "id": item_id}] * count
    return {"model": "sim-echo", "input": [*refs, {"role": "user", "content": "go on"}]}


@pytest.fixture
async def keyed(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[RunningEdge]:
    running = await start_edge(nursery, replace(edge_config(sim), keys=KEYS))
    yield running
    await stop_edge(running)


async def test_many_references_to_a_large_item_are_a_413_before_any_expansion(
    edge: RunningEdge,
) -> None:
    """A ~2 MB stored item referred to 300 and 3,000 times (bodies of 20 and 200 KiB,
    600 MB and 6 GB expanded): each a 413 `references_too_large` whose message names
    the nodes' message limit, while the edge's process grows by a few MiB at most (no
    copy per reference, no MemoryError, no 500) and holds nothing of its budget after;
    one reference to the same item is still answered."""
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as http:
        _, item_id = await _store_big_answer(http)
        for count in (300, 3000):
            body = json.dumps(_referring(item_id, count)).encode()
            assert len(body) < 256 * 1024
            tracemalloc.start()
            try:
                refused = await http.post(
                    RESPONSES, content=body, headers={"content-type": "application/json"}
                )
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            print(f"{count} references: traced peak {peak / MiB:.1f} MiB")
            assert refused.status_code == 413, refused.text
            error = refused.json()["error"]
            assert (error["type"], error["code"], error["param"]) == (
                "invalid_request_error", "references_too_large", "input",
            )  # fmt: skip
            assert str(MAX_MESSAGE_BYTES) in error["message"]
            # The body, the one stored item as read (~4 MB of its record) and the
            # edge's own work: far from the 600 MB the references stand for.
            assert peak < 16 * MiB
            assert edge.edge.admission.held == 0
        assert (await http.get("/healthz")).status_code == 200
        once = await http.post(RESPONSES, json=_referring(item_id, 1))
        assert once.status_code == 200, once.text
        assert once.json()["output"][0]["content"][0]["text"] == "go on"


async def test_count_tokens_and_stored_reads_count_against_rpm(keyed: RunningEdge) -> None:
    """rpm = 3: a response stored, its input items read, a token count: the fourth
    request of any of them (input items, a stored response, count_tokens, a chat) is
    429 with Retry-After and the key's headers, as for chat; another key is served."""
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30) as http:
        auth = _auth("sk-team-a")
        stored = await http.post(RESPONSES, json={"model": "sim-echo", "input": "hi"}, headers=auth)
        assert stored.status_code == 200
        response_id = stored.json()["id"]
        items = await http.get(f"{RESPONSES}/{response_id}/input_items", headers=auth)
        assert items.status_code == 200
        assert items.headers["x-ratelimit-remaining-requests"] == "1"
        count_body = {"model": "sim-echo", "messages": [{"role": "user", "content": "hi"}]}
        counted = await http.post(COUNT, json=count_body, headers=auth)
        assert counted.status_code == 200
        assert counted.headers["x-ratelimit-remaining-requests"] == "0"
        for method, path, body in (
            ("GET", f"{RESPONSES}/{response_id}/input_items", None),
            ("GET", f"{RESPONSES}/{response_id}", None),
            ("POST", COUNT, count_body),
            ("POST", RESPONSES, {"model": "sim-echo", "input": "hi"}),
        ):
            over = await http.request(method, path, json=body, headers=auth)
            assert over.status_code == 429, (path, over.text)
            assert 1 <= int(over.headers["retry-after"]) <= 60
            assert over.headers["x-ratelimit-remaining-requests"] == "0"
            assert "requests per minute" in over.text
        free = await http.post(COUNT, json=count_body, headers=_auth("sk-free"))
        assert free.status_code == 200
    assert keyed.edge.admission.held == 0


async def _partial_count(url: str, secret: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A 4 MB count_tokens request of which only the head and 64 KiB of body are sent:
    the answer, read while the rest of the body is still to come (it never is)."""
    host, _, port = url.removeprefix("http://").partition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    conn = h11.Connection(h11.CLIENT)
    head = h11.Request(
        method="POST", target=COUNT,
        headers=[("host", host), ("x-api-key", secret), ("anthropic-version", "2023-06-01"),
                 ("content-type", "application/json"), ("content-length", str(4 * MiB))],
    )  # fmt: skip
    first = b'{"model": "sim-echo", "messages": [' + b" " * (2**16 - 35)
    try:
        await stream.send_all(conn.send(head) + conn.send(h11.Data(data=first)))
        with trio.fail_after(20):
            status, headers, content = await read_response(stream, conn)
        return status, headers, json.loads(content)
    finally:
        await stream.aclose()


async def test_a_throttled_keys_count_tokens_body_is_not_parsed(keyed: RunningEdge) -> None:
    """A key over its rpm sending a 4 MB count_tokens body: the 429 (Anthropic's shape,
    Retry-After, the rate-limit headers) comes while all but 64 KiB of the body is
    still unsent, so nothing of it was read whole or parsed."""
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30) as http:
        for _ in range(3):
            ok = await http.post(
                COUNT, json={"model": "sim-echo", "messages": [{"role": "user", "content": "x"}]},
                headers=_auth("sk-team-a"),
            )  # fmt: skip
            assert ok.status_code == 200
    status, headers, body = await _partial_count(keyed.url, "sk-team-a")
    assert status == 429
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
