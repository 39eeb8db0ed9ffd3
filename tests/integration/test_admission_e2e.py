"""Admission control over a real edge and a real node process: slots, the queue, shedding.

The node allows `max_runs = 2`; the queue holds 3 (one client may take them all: these
tests are of the bound for the whole edge; tests/integration/test_fair_e2e.py has
the tenants' and tiers'). Two streams that hang
mid-answer hold both slots; requests beyond them wait in the queue, and
past the queue's bounds are answered 503 `overloaded` with `Retry-After`,
before any byte. A queued client that leaves never starts a run. Waits are
bounded polls on in-process state; nothing asserts a duration.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import trio

from edge.config import AdmissionConfig, Config, NodeConfig, ServerConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    poll,
    script,
    start_edge,
    stop_edge,
)

CHAT = "/v1/chat/completions"
WAIT_S = 20.0
HOLD = chat_body("sim-script", script({"type": "delta", "delta": "x"}, {"type": "hang"}),
                 stream=True)  # fmt: skip


async def _edge(
    nursery: trio.Nursery, sim: SimProcess, queue_timeout_s: float, policy: str = "fair"
) -> RunningEdge:
    admission = AdmissionConfig(
        max_queue=3, queue_timeout_s=queue_timeout_s, policy=policy, max_queue_per_key=10
    )
    config = Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
        admission=admission,
        nodes=(NodeConfig("sim", sim.address, max_runs=2),),
    )
    return await start_edge(nursery, config)


def _sample(edge: RunningEdge, name: str, **labels: str) -> float:
    return edge.edge.metrics.registry.get_sample_value(name, labels) or 0.0


def _shed(edge: RunningEdge, reason: str) -> float:
    """Requests shed for `reason`, whatever their tier (or before it was known)."""
    tiers = ("priority", "default", "flex", "unknown")
    return sum(_sample(edge, "iop_edge_shed_total", reason=reason, tier=t) for t in tiers)


async def _hold(http: httpx.AsyncClient, held: list[str]) -> None:
    """A stream mid-answer that keeps its slot until cancelled (its client leaves)."""
    async with http.stream("POST", CHAT, json=HOLD) as response:
        async for line in response.aiter_lines():
            if '"content":"x"' in line:
                held.append(json.loads(line[6:])["id"])
                await trio.sleep_forever()


def _assert_overloaded(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("overloaded", "overloaded")
    assert error["message"]


async def test_a_full_queue_answers_503_overloaded_at_once(
    nursery: trio.Nursery, node: SimProcess
) -> None:
    """Two runs hold both slots, three requests wait: the sixth concurrent request gets 503
    overloaded with Retry-After while the three still wait; once the slots are given back
    the three are answered, in full."""
    edge = await _edge(nursery, node, queue_timeout_s=60)
    admission = edge.edge.admission
    held: list[str] = []
    answers: list[httpx.Response] = []

    async def queued(http: httpx.AsyncClient) -> None:
        answers.append(await http.post(CHAT, json=chat_body("sim-echo", "after the wait")))

    async with (
        httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http,
        trio.open_nursery() as waiting,
        trio.open_nursery() as holders,
    ):
        for _ in range(2):
            holders.start_soon(_hold, http, held)
        await poll(lambda: len(held) == 2)
        for _ in range(3):
            waiting.start_soon(queued, http)
        await poll(lambda: admission.depth == 3)
        assert _sample(edge, "iop_edge_queue_depth", tier="default") == 3
        _assert_overloaded(await http.post(CHAT, json=chat_body("sim-echo", "sixth")))
        assert admission.depth == 3  # answered while the queue was still full
        holders.cancel_scope.cancel()  # the holders leave: their slots free up
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert {r.json()["choices"][0]["message"]["content"] for r in answers} == {"after the wait"}
    assert _shed(edge, "queue_full") == 1
    await edge.wait_idle()
    assert admission.depth == 0
    assert _sample(edge, "iop_edge_queue_seconds_count") == 3
    await stop_edge(edge)


async def test_a_queued_client_that_leaves_never_starts_a_run(
    nursery: trio.Nursery, node: SimProcess
) -> None:
    """A client that hangs up while its request waits in the queue leaves the queue; no run
    is started for it, on the node or in the edge, and it is counted once, cancelled."""
    edge = await _edge(nursery, node, queue_timeout_s=60)
    admission = edge.edge.admission
    held: list[str] = []
    async with (
        httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http,
        trio.open_nursery() as holders,
    ):
        for _ in range(2):
            holders.start_soon(_hold, http, held)
        await poll(lambda: len(held) == 2)
        async with trio.open_nursery() as leaver:
            body = chat_body("sim-echo", "never run")
            leaver.start_soon(
                lambda: http.post(CHAT, json=body, headers={"X-Request-Id": "leaver"})
            )
            await poll(lambda: admission.depth == 1)
            leaver.cancel_scope.cancel()  # the client hangs up while queued
        await poll(lambda: admission.depth == 0)
        holders.cancel_scope.cancel()
    await edge.wait_idle()
    assert all(info.request_id != "leaver" for info, _ in edge.outcomes)
    await poll(lambda: len([r for r in node.runs() if "outcome" in r]) >= 2)
    runs = [r for r in node.runs() if "outcome" in r]
    assert {r["run_id"] for r in runs} == {h.removeprefix("chatcmpl-") for h in held}
    assert _sample(
        edge, "iop_edge_requests_total", model="sim-echo", node="none", stream="false",
        status="cancelled", api="chat",
    ) == 1  # fmt: skip
    await stop_edge(edge)


async def test_a_wait_past_the_queue_timeout_answers_503(
    nursery: trio.Nursery, node: SimProcess
) -> None:
    """No slot frees within queue_timeout_s: 503 overloaded with Retry-After, streamed or
    not (no byte of a stream before it), counted as shed queue_timeout."""
    edge = await _edge(nursery, node, queue_timeout_s=0.2)
    held: list[str] = []
    async with (
        httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http,
        trio.open_nursery() as holders,
    ):
        for _ in range(2):
            holders.start_soon(_hold, http, held)
        await poll(lambda: len(held) == 2)
        for stream in (False, True):
            body: dict[str, Any] = chat_body("sim-echo", "too late", stream=stream)
            _assert_overloaded(await http.post(CHAT, json=body))
        holders.cancel_scope.cancel()
    assert _shed(edge, "queue_timeout") == 2
    assert edge.edge.admission.depth == 0
    await stop_edge(edge)


async def _read_answer(stream: trio.SocketStream) -> bytes:
    """One HTTP/1.1 answer with a Content-Length, read whole."""
    data = b""
    with trio.fail_after(WAIT_S):
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )  # fmt: skip
        while len(body) < length:
            body += await stream.receive_some(65536)
    return head + b"\r\n\r\n" + body


async def _full(
    nursery: trio.Nursery,
    node: SimProcess,
    http: httpx.AsyncClient,
    waiting: trio.Nursery,
    holders: trio.Nursery,
) -> RunningEdge:
    """An edge whose two slots are held and whose queue of three is full (policy fifo:
    the server sheds a request from its head only when whose it is does not matter)."""
    edge = await _edge(nursery, node, queue_timeout_s=60, policy="fifo")
    held: list[str] = []
    http.base_url = httpx.URL(edge.url)
    for _ in range(2):
        holders.start_soon(_hold, http, held)
    await poll(lambda: len(held) == 2)
    for _ in range(3):
        waiting.start_soon(partial(http.post, CHAT, json=chat_body("sim-echo", "after the wait")))
    await poll(lambda: edge.edge.admission.depth == 3)
    return edge


async def test_a_full_queue_sheds_at_the_connection_before_reading_the_body(
    nursery: trio.Nursery, node: SimProcess
) -> None:
    """With the queue full, the server answers a new HTTP/1.1 request 503 overloaded from
    its head alone: the 1 MiB body is never parsed, and the answer (with Retry-After, the
    app's own body) is read in full, not cut by a reset, then the connection closes. A
    request that arrived whole is answered and its connection kept. An HTTP/2 request,
    which the server does not look into, gets the same answer from the app."""
    async with (
        httpx.AsyncClient(timeout=WAIT_S) as http,
        trio.open_nursery() as waiting,
        trio.open_nursery() as holders,
    ):
        edge = await _full(nursery, node, http, waiting, holders)
        body = json.dumps(chat_body("sim-echo", "x" * 2**20)).encode()
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        host, port = edge.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(head + body[:1000])  # the rest of the body never goes
            answer = b""
            with trio.fail_after(WAIT_S):
                while data := await stream.receive_some(65536):
                    answer += data
        status, _, rest = answer.partition(b"\r\n")
        assert status == b"HTTP/1.1 503 Service Unavailable"
        headers, _, payload = rest.partition(b"\r\n\r\n")
        assert b"retry-after: 1" in headers.lower()
        assert b"connection: close" in headers.lower()
        error = json.loads(payload)["error"]
        assert (error["type"], error["code"]) == ("overloaded", "overloaded")
        # A whole request in one read is dropped and answered; the connection goes on.
        small = json.dumps(chat_body("sim-echo", "small")).encode()
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(
                f"POST {CHAT} HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(small)}\r\n\r\n".encode()
                + small
            )
            kept = await _read_answer(stream)
            assert kept.startswith(b"HTTP/1.1 503 ")
            assert b"connection: close" not in kept.lower()
            await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n")
            assert (await _read_answer(stream)).startswith(b"HTTP/1.1 200 ")
        async with httpx.AsyncClient(
            base_url=edge.url, http1=False, http2=True, timeout=WAIT_S
        ) as h2:
            response = await h2.post(CHAT, json=chat_body("sim-echo", "over h2"))
            assert response.http_version == "HTTP/2"
            _assert_overloaded(response)
        assert edge.edge.admission.depth == 3
        assert _shed(edge, "queue_full") == 3
        holders.cancel_scope.cancel()
    await edge.wait_idle()
    await stop_edge(edge)
