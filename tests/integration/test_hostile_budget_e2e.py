"""End to end: what requests hold in the edge is bounded, over a real node process.

The memory budget:

A request holds its parsed form from its parse to the end of its cycle, queued or
running; the edge charges its estimate (`edge.api.footprint`) to one budget
(`[admission] memory_budget_bytes`) before it is queued. Here the budget fits one
request of many small parts: a second one is answered 503 `overloaded` with
Retry-After while the first holds its share, and every way a request ends (answered,
streamed, its client gone mid-stream, a node error, refused after its parse) gives
its bytes back: the count and its gauge return to 0. The body a request came as is
let go once it is parsed: a request whose run hangs holds no copy of it.

HTTP/2 streams left unread: a client opens streams and never opens their
flow-control window, so their answers cannot be written. Over a real `iop-edge`
process (its RSS read with psutil), 800 such streams over 8 connections cost a
bounded amount (each connection closed with GOAWAY ENHANCE_YOUR_CALM past its cap),
every run ends, the stalled-stream gauge returns to 0, and a normal HTTP/2 client on
another connection reads a large answer meanwhile.

Waits are bounded polls on in-process state or on /metrics; nothing asserts a duration.
"""

from __future__ import annotations

import gc
import json
import re
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import httpx
import trio

from edge.api.footprint import footprint
from edge.api.surfaces import CHAT as CHAT_API
from edge.config import AdmissionConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    edge_config,
    poll,
    script,
    start_edge,
    stop_edge,
)
from tests.integration.edgeproc import edge_process
from tests.integration.test_hostile_memory_e2e import BIG_DELTAS, MiB, RssPeak

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
    """What the edge charges for `body`, about: its parsed form's estimate (the body itself
    is let go once parsed)."""
    return footprint(CHAT_API.parse(json.dumps(body).encode()))


HANG = script({"type": "delta", "delta": "x"}, {"type": "hang"})


async def _edge(nursery: trio.Nursery, sim: SimProcess, budget: int) -> RunningEdge:
    config = edge_config(sim)
    config = replace(config, admission=AdmissionConfig(memory_budget_bytes=budget))
    return await start_edge(nursery, config)


def _gauge(edge: RunningEdge) -> float:
    value = edge.edge.metrics.registry.get_sample_value("iop_edge_request_memory_bytes")
    assert value is not None
    return value


async def _given_back(edge: RunningEdge) -> None:
    """Every request's bytes are back: the budget's count and its gauge say 0."""
    admission = edge.edge.admission
    await poll(lambda: admission.held == 0)
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
    admission = edge.edge.admission
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
            "iop_edge_shed_total", {"reason": "memory_budget", "tier": "unknown"}
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


# --- HTTP/2 streams left unread -------------------------------------------------------

CONNECTIONS = 8
STREAMS = 100  # per connection: the edge's SETTINGS_MAX_CONCURRENT_STREAMS
# Each stream's answer: 64 deltas of 64 KiB (4 MiB), far more than any window lets out.
LARGE = script({**BIG_DELTAS, "repeat": 64}, {"type": "complete"})


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


async def _unread_streams(url: str) -> h2.events.ConnectionTerminated | None:
    """One connection: STREAMS requests for large streamed answers, whose windows it never
    opens (it reads every frame, sends no WINDOW_UPDATE), until the edge closes it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    body = json.dumps(
        {"model": "sim-script", "stream": True, "messages": [{"role": "user", "content": LARGE}]}
    ).encode()
    headers = [(":method", "POST"), (":path", CHAT), (":scheme", "http"), (":authority", host),
               ("content-type", "application/json")]  # fmt: skip
    for _ in range(STREAMS):
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(stream_id, headers)
        conn.send_data(stream_id, body, end_stream=True)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        try:
            await stream.send_all(conn.data_to_send())
            with trio.fail_after(WAIT_S):
                while data := await stream.receive_some(65536):
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.ConnectionTerminated):
                            return event
                    if pending := conn.data_to_send():  # SETTINGS and PING ACKs only
                        await stream.send_all(pending)
        except (trio.BrokenResourceError, h2.exceptions.ProtocolError):
            pass
    return None


async def test_h2_streams_left_unread_cost_bounded_memory_and_are_given_back(
    tmp_path: Path, sim: SimProcess
) -> None:
    """800 streams over 8 connections whose flow-control windows are never opened: each
    connection is closed with GOAWAY ENHANCE_YOUR_CALM, the edge's RSS grows by far less
    than their answers would hold (it grew ~590 MiB, and on, before the bound), every run
    ends, the stalled-stream gauge returns to 0, and a normal HTTP/2 client on another
    connection reads a 4 MiB answer meanwhile."""
    toml = (
        '[server]\nlisten = "127.0.0.1:0"\n'
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\nmax_runs = 2000\n'
    )
    async with (
        edge_process(tmp_path, toml) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S, http1=False, http2=True) as client,
    ):
        warm = await client.post(CHAT, json={"model": "sim-echo", "messages": [
            {"role": "user", "content": "warm up"}]})  # fmt: skip
        assert warm.status_code == 200
        assert warm.http_version == "HTTP/2"
        rss = RssPeak(edge.process.pid)
        ends: list[h2.events.ConnectionTerminated | None] = []
        received = 0

        async def unread() -> None:
            ends.append(await _unread_streams(edge.url))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rss.watch)
            try:
                async with trio.open_nursery() as attackers:
                    for _ in range(CONNECTIONS):
                        attackers.start_soon(unread)
                    large = {"model": "sim-script", "stream": True,
                             "messages": [{"role": "user", "content": LARGE}]}  # fmt: skip
                    async with client.stream("POST", CHAT, json=large) as response:
                        assert response.status_code == 200
                        async for chunk in response.aiter_bytes():
                            received += len(chunk)
            finally:
                growth = rss.stop()
        print(f"edge RSS growth, {CONNECTIONS}x{STREAMS} unread HTTP/2 streams: "
              f"{growth / MiB:.1f} MiB")  # fmt: skip
        assert received > 64 * 65536
        assert len(ends) == CONNECTIONS
        for end in ends:
            assert end is not None
            assert end.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
            assert b"flow-control window" in (end.additional_data or b"")
        assert growth < 300 * MiB
        with trio.fail_after(WAIT_S):
            while True:
                metrics = (await client.get("/metrics")).text
                # The streams end, then their connections' stalled streams are let go.
                if _metric(metrics, "iop_edge_active_streams") == 0 and (
                    _metric(metrics, "iop_edge_h2_stalled_streams") == 0
                ):
                    break
                await trio.sleep(0.05)  # another process's state: poll, bounded
        closed = _metric(metrics, 'iop_edge_connection_errors_total{kind="h2_stalled_streams"}')
        assert closed == CONNECTIONS
        assert edge.process.poll() is None


def _bodies_held(length: int, prefix: bytes, ours: bytes) -> int:
    """Bytes objects of `length` starting with `prefix` (not `ours`) that an object the
    collector sees refers to (frames of suspended coroutines included).

    Modules are not asked (their dicts are among the objects): on CPython 3.12.1 the
    referents of `_asyncio` include freed future iterators, and taking them corrupts the
    interpreter (a crash or a hang in a later collection: python/cpython#122695)."""
    found: dict[int, bytes] = {}
    for holder in gc.get_objects():
        if isinstance(holder, ModuleType):
            continue
        for value in gc.get_referents(holder):
            if (
                type(value) is bytes
                and len(value) == length
                and value is not ours
                and value.startswith(prefix)
            ):
                found[id(value)] = value
    return len(found)


async def test_a_running_request_holds_no_body(edge: RunningEdge) -> None:
    """While a non-streamed request's run hangs on its node (its handler waiting for the
    answer), no copy of its 1 MiB body is held in the edge: the parse took what it
    needed, then the body was let go."""
    padding = "p" * MiB
    body = chat_body("sim-script", script({"type": "hang"}))
    body["messages"].insert(0, {"role": "user", "content": padding})
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    port = int(edge.url.rsplit(":", 1)[1])
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        await stream.send_all(head)
        await stream.send_all(data)
        with trio.fail_after(WAIT_S):
            while not any(run.accepted for run in edge.edge.runs.live):  # noqa: ASYNC110
                await trio.sleep(0.01)  # in-process state with no event to wait on
        assert _bodies_held(len(data), data[:64], data) == 0
    finally:
        await stream.aclose()
    await edge.wait_idle(WAIT_S)
