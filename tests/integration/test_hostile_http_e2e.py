"""Hostile packets and clients at the HTTP front door, over real sockets.

Each one-packet trigger that used to end the process (hypercorn 0.18.0's trio
worker let one connection's exception end `trio.run`) is sent, without an API
key, to a real edge with API keys on while a stream is in flight: the edge
must stay up, answer a normal request, and finish the stream normally. Then
the connection limit, the slow reader, the request-head checks, requests sent
too slowly, HTTP/2 floods, and the file-descriptor limit (an edge subprocess
with a low hard limit).
"""

from __future__ import annotations

import base64
import json
import re
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h11
import httpx
import pytest
import trio
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
)

from edge.config import Config
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    edge_config,
    script,
    start_edge,
    stop_edge,
)
from tests.integration.edgeproc import edge_process
from tests.integration.rawhttp import read_response

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
BOUND_S = 20.0  # generous: nothing here should come close


def _config(sim: SimProcess, **server: Any) -> Config:
    config = edge_config(sim)
    return replace(config, server=replace(config.server, api_keys=(KEY,), **server))


@pytest.fixture
async def edge(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[RunningEdge]:
    running = await start_edge(nursery, _config(sim))
    yield running
    await stop_edge(running)


def _address(edge: RunningEdge) -> tuple[str, int]:
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _errors(edge: RunningEdge, kind: str) -> float:
    value = edge.edge.metrics.registry.get_sample_value(
        "iop_edge_connection_errors_total", {"kind": kind}
    )
    return value or 0.0


def _open_connections(edge: RunningEdge) -> float:
    value = edge.edge.metrics.registry.get_sample_value("iop_edge_open_connections")
    return value or 0.0


async def _open(edge: RunningEdge) -> trio.SocketStream:
    host, port = _address(edge)
    return await trio.open_tcp_stream(host, port)


async def _read_to_eof(stream: trio.SocketStream) -> bytes:
    """Everything until the edge closes the connection (a reset counts as closed)."""
    out = bytearray()
    with trio.fail_after(BOUND_S):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not data:
                break
            out += data
    return bytes(out)


async def _read_response(stream: trio.SocketStream) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response, parsed by h11 as a client would."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    client.send(h11.EndOfMessage())
    with trio.fail_after(BOUND_S):
        return await read_response(stream, client)


# --- the eight one-packet triggers ------------------------------------------------


def _h2c(settings: bytes) -> bytes:
    return (
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: " + settings + b"\r\n\r\n"
    )


def _settings(*pairs: tuple[int, int], extra: bytes = b"") -> bytes:
    raw = b"".join(struct.pack(">HI", key, value) for key, value in pairs) + extra
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


async def _h11_trigger(edge: RunningEdge, payload: bytes) -> None:
    """An HTTP/1.1 packet: answered as plain HTTP/1.1 (never 101), the edge unharmed."""
    stream = await _open(edge)
    async with stream:
        await stream.send_all(payload)
        status, _, body = await _read_response(stream)
    assert status in (401, 404), (status, body)
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


def _h2_client() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    return conn


async def _h2_answered_then_data(edge: RunningEdge, method: str, path: str) -> None:
    """HTTP/2 prior knowledge: a request the edge answers, then DATA on its stream."""
    conn = _h2_client()
    host = _address(edge)[0]
    headers = [(":method", method), (":path", path), (":scheme", "http"), (":authority", host)]
    conn.send_headers(1, headers, end_stream=False)
    stream = await _open(edge)
    async with stream:
        await stream.send_all(conn.data_to_send())
        status, ended = None, False
        with trio.fail_after(BOUND_S):
            while not ended:
                data = await stream.receive_some(65536)
                assert data, "the edge closed the connection before answering"
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        status = dict(event.headers)[b":status"]
                    ended = ended or isinstance(event, h2.events.StreamEnded)
        assert status == (b"200" if method == "GET" else b"401")
        # The answer is complete and the edge has forgotten the stream; our side is
        # still open, so h2 accepts more DATA on it.
        await _h2_frames_then_ping(stream, [])
        await _h2_frames_then_ping(stream, [DataFrame(1, data=b"late data")])


async def _h2_frames_then_ping(stream: trio.SocketStream, frames: list[Frame]) -> None:
    """Send frames, then a PING: the answer is its ACK or the connection's end, never a hang."""
    await stream.send_all(b"".join(f.serialize() for f in frames))
    await stream.send_all(PingFrame(0, opaque_data=b"12345678").serialize())
    await _read_to_eof_or_ping_ack(stream)


async def _read_to_eof_or_ping_ack(stream: trio.SocketStream) -> None:
    buf = b""
    with trio.fail_after(BOUND_S):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return
            if not data:
                return
            buf += data
            # A PING ACK: type 0x6, flags 0x1, stream 0, our opaque data.
            if b"\x00\x00\x08\x06\x01\x00\x00\x00\x0012345678" in buf:
                return


async def _h2_priority_flood(edge: RunningEdge) -> None:
    conn = _h2_client()
    stream = await _open(edge)
    async with stream:
        await stream.send_all(conn.data_to_send())
        frames: list[Frame] = [
            PriorityFrame(2 * n + 1, depends_on=0, stream_weight=16) for n in range(1100)
        ]
        await _h2_frames_then_ping(stream, frames)


_WEBSOCKET = (
    b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: bKdPyn3u98cTfZJSh4TNeQ==\r\n\r\nx"
)

TRIGGERS: dict[str, Callable[[RunningEdge], Awaitable[None]]] = {
    "h2c_settings_not_base64": lambda e: _h11_trigger(e, _h2c(b"A")),
    "h2c_settings_5_bytes": lambda e: _h11_trigger(e, _h2c(_settings(extra=b"\x00\x02\0\0\0"))),
    "h2c_enable_push_7": lambda e: _h11_trigger(e, _h2c(_settings((0x2, 7)))),
    "h2c_initial_window_2_31": lambda e: _h11_trigger(e, _h2c(_settings((0x4, 2**31)))),
    "h2_data_after_early_401": lambda e: _h2_answered_then_data(e, "POST", CHAT),
    "h2_data_after_healthz": lambda e: _h2_answered_then_data(e, "GET", "/healthz"),
    "h2_priority_flood": _h2_priority_flood,
    "websocket_upgrade_and_a_byte": lambda e: _h11_trigger(e, _WEBSOCKET),
}  # fmt: skip
# The triggers that still raise inside hypercorn's HTTP/2 code: contained, counted, closed.
RAISING = {"h2_data_after_early_401", "h2_data_after_healthz", "h2_priority_flood"}


async def _stream_lines(client: httpx.AsyncClient, body: dict[str, object]) -> list[str]:
    async with client.stream("POST", CHAT, json=body, headers=AUTH) as response:
        assert response.status_code == 200
        return [line async for line in response.aiter_lines() if line]


@pytest.mark.parametrize("trigger", list(TRIGGERS))
async def test_one_packet_trigger_leaves_the_edge_serving(edge: RunningEdge, trigger: str) -> None:
    """The trigger is answered or its connection closed; a stream in flight ends with
    [DONE], and a new request is served. An exception raised while serving the
    trigger's connection is counted once; the upgrades are not served (no 101)."""
    in_flight = script(
        {"type": "delta", "delta": "before "},
        {"sleep_ms": 100},
        {"type": "delta", "delta": "after"},
        {"type": "complete", "metadata": {"finish_reason": "stop"}},
    )
    lines: list[str] = []
    async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND_S) as client:
        async with trio.open_nursery() as nursery:

            async def stream() -> None:
                lines.extend(
                    await _stream_lines(client, chat_body("sim-script", in_flight, stream=True))
                )

            nursery.start_soon(stream)
            await TRIGGERS[trigger](edge)
        assert _errors(edge, "exception") == (1 if trigger in RAISING else 0)
        assert lines[-1] == "data: [DONE]"
        assert (
            "".join(
                json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                for line in lines[:-1]
                if json.loads(line[6:])["choices"]
            )
            == "before after"
        )
        health = await client.get("/healthz")
        assert health.status_code == 200
        answer = await client.post(CHAT, json=chat_body("sim-echo", "still here"), headers=AUTH)
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["message"]["content"] == "still here"


# --- request heads h11 would accept ----------------------------------------------

BAD_HEADS = {
    "content_length_and_transfer_encoding": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    "obsolete_line_folding": (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Folded: a\r\n  b\r\n\r\n",
        400,
    ),
    "head_too_large": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000, 431),
}


def _without_request(edge: RunningEdge) -> float:
    name = "iop_edge_connections_without_request_total"
    return edge.edge.metrics.registry.get_sample_value(name) or 0.0


async def test_connections_that_carry_no_request_are_counted(edge: RunningEdge) -> None:
    """A connection closed (FIN) or reset (RST) before sending a request is counted as one
    without a request; a connection that carried a request is not."""
    before = _without_request(edge)
    async with await _open(edge) as stream:
        await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
    quiet = await _open(edge)
    await quiet.aclose()
    reset = await _open(edge)
    reset.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await reset.aclose()
    with trio.fail_after(BOUND_S):
        while _open_connections(edge) > 0:  # noqa: ASYNC110 - a gauge, no event
            await trio.sleep(0.01)
    assert _without_request(edge) - before == 2


async def test_idle_connections_count_and_close_at_the_idle_timeout(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """Connections that send nothing (they wait in the server's waiting set): a request
    on a connection opened after 300 of them is served; they count as open connections
    (and against max_connections: the next one past it gets 503); each is closed at
    idle_timeout_s and counted as a connection without a request."""
    edge = await start_edge(nursery, _config(sim, idle_timeout_s=1.0, max_connections=302))
    before = _without_request(edge)
    idle = [await _open(edge) for _ in range(300)]
    async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND_S) as client:
        assert (await client.get("/healthz")).status_code == 200
        with trio.fail_after(BOUND_S):
            while _open_connections(edge) < 301:  # noqa: ASYNC110 - a gauge, no event
                await trio.sleep(0.01)
        extra = await _open(edge)  # the 302nd
        refused = await _open(edge)  # past the limit
        async with refused:
            await refused.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _read_to_eof(refused)).startswith(b"HTTP/1.1 503 ")
        await extra.aclose()
    for stream in idle:
        assert await _read_to_eof(stream) == b""  # closed by the edge, nothing sent
        await stream.aclose()
    with trio.fail_after(BOUND_S):
        while _open_connections(edge) > 0:  # noqa: ASYNC110 - a gauge, no event
            await trio.sleep(0.01)
    assert _without_request(edge) - before == 301
    await stop_edge(edge)


async def test_the_drain_closes_connections_that_sent_nothing_at_once(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """Shutting down, the edge closes connections that never sent a request at once
    (idle_timeout_s is an hour here)."""
    edge = await start_edge(nursery, _config(sim, idle_timeout_s=3600.0))
    idle = [await _open(edge) for _ in range(20)]
    with trio.fail_after(BOUND_S):
        while _open_connections(edge) < 20:  # noqa: ASYNC110 - a gauge, no event
            await trio.sleep(0.01)
    await stop_edge(edge)
    for stream in idle:
        assert await _read_to_eof(stream) == b""
        await stream.aclose()


@pytest.mark.parametrize("case", list(BAD_HEADS))
async def test_bad_request_head_is_refused_and_the_connection_closed(
    edge: RunningEdge, case: str
) -> None:
    """RFC 9112 6.1 and 5.2: an OpenAI-shaped error, then the connection ends."""
    payload, status = BAD_HEADS[case]
    stream = await _open(edge)
    async with stream:
        await stream.send_all(payload)
        raw = await _read_to_eof(stream)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert _errors(edge, "bad_request") == 1


async def test_a_bad_head_after_a_good_request_closes_the_connection(edge: RunningEdge) -> None:
    """Pipelined: the first request is answered, then the second's bad head gets its 400
    and the connection ends."""
    good = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    bad = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\r\n\tb\r\n\r\n"
    stream = await _open(edge)
    async with stream:
        await stream.send_all(good + bad)
        raw = await _read_to_eof(stream)
    assert raw.startswith(b"HTTP/1.1 200 ")
    assert raw.count(b"HTTP/1.1 ") == 2
    assert b"HTTP/1.1 400 " in raw
    assert _errors(edge, "bad_request") == 1


# --- connections ---------------------------------------------------------------


async def test_connections_past_the_limit_get_503_and_health_returns_once_one_closes(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """With max_connections=3 held by streams in flight, a new connection gets a 503
    JSON answer and is closed at once; when one closes, /healthz answers again.
    Refusals are counted, and logged at most once a second."""
    edge = await start_edge(nursery, _config(sim, max_connections=3))
    # A first delta: the status (200) is committed at the first byte of output.
    hang = json.dumps(
        chat_body("sim-script", script({"type": "delta", "delta": "x"}, {"type": "hang"}),
                  stream=True)
    ).encode()  # fmt: skip
    request = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(hang)}\r\n\r\n"
    ).encode() + hang
    held = [await _open(edge) for _ in range(3)]
    for stream in held:
        await stream.send_all(request)
        with trio.fail_after(BOUND_S):
            assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
    for _ in range(3):
        refused = await _open(edge)
        async with refused:
            await refused.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = await _read_to_eof(refused)
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), raw
        assert json.loads(body)["error"]["code"] == "too_many_connections"
    assert _errors(edge, "over_limit") == 3
    await held.pop().aclose()
    with trio.fail_after(BOUND_S):
        while _open_connections(edge) > 2:  # noqa: ASYNC110 - a gauge, no event
            await trio.sleep(0.01)
    async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND_S) as client:
        assert (await client.get("/healthz")).status_code == 200
    for stream in held:
        await stream.aclose()
    await stop_edge(edge)


# --- a client that reads nothing -------------------------------------------------


async def test_a_client_that_stops_reading_loses_its_connection(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """A streaming client that never reads, a node answering big deltas: once a write
    makes no progress for slow_client_s the edge closes the connection, and the run is
    cancelled once at the node."""
    config = _config(sim)
    config = replace(config, timeouts=replace(config.timeouts, slow_client_s=0.5))
    edge = await start_edge(nursery, config)
    big = script(
        {"type": "delta", "delta": "x" * 65536, "repeat": 200},
        {"type": "hang"},  # the run ends only when the edge cancels it
    )
    body = json.dumps(chat_body("sim-script", big, stream=True)).encode()
    host, port = _address(edge)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, port))
    stream = trio.SocketStream(sock)
    async with stream:
        await stream.send_all(
            (
                f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        with trio.fail_after(BOUND_S):
            while _errors(edge, "slow_client") < 1:  # noqa: ASYNC110 - a counter, no event
                await trio.sleep(0.02)
            while not edge.outcomes:  # noqa: ASYNC110 - recorded when the run ends
                await trio.sleep(0.01)
        info, outcome = edge.outcomes[0]
        assert outcome.status == "cancelled"
        record = await sim.wait_run(info.run_id)
        assert record["outcome"] == "cancelled"
        assert record["cancel_rpcs"] == 1
        raw = await _read_to_eof(stream)
    assert not raw.endswith(b"data: [DONE]\n\n")
    assert _errors(edge, "slow_client") == 1
    await stop_edge(edge)


# --- requests sent too slowly ----------------------------------------------------


async def _trickle(stream: trio.SocketStream, payload: bytes, every_s: float) -> None:
    """Send `payload` a byte at a time; stops quietly once the edge has closed."""
    for n in range(len(payload)):
        try:
            await stream.send_all(payload[n : n + 1])
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        await trio.sleep(every_s)  # the client's pace is the point


async def _trickled_answer(edge: RunningEdge, head: bytes, payload: bytes) -> bytes:
    """Send `head` at once, then `payload` slowly; everything the edge sent back."""
    stream = await _open(edge)
    async with stream:
        await stream.send_all(head)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_trickle, stream, payload, 0.05)
            raw = await _read_to_eof(stream)
            nursery.cancel_scope.cancel()
    return raw


async def test_a_head_sent_a_byte_at_a_time_is_cut_with_408_at_the_idle_timeout(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """Bytes that keep arriving do not extend idle_timeout_s: a head still incomplete
    then gets a 408 JSON answer and the connection closes (slowloris). A connection
    that sends nothing is closed quietly, without a 408 and without being counted."""
    edge = await start_edge(nursery, _config(sim, idle_timeout_s=0.3))
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"s" * 400 + b"\r\n\r\n"
    raw = await _trickled_answer(edge, b"", head)  # 400 bytes at 20 a second: 20 s
    status_line, _, rest = raw.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", raw
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout"
    assert "request head not received within 0.3s" in error["message"]
    assert _errors(edge, "slow_request") == 1
    quiet = await _open(edge)
    async with quiet:
        assert await _read_to_eof(quiet) == b""
    assert _errors(edge, "slow_request") == 1
    async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND_S) as client:
        assert (await client.get("/healthz")).status_code == 200
    await stop_edge(edge)


async def test_a_body_sent_a_byte_at_a_time_is_cut_with_408_at_the_body_timeout(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """An authenticated request whose body trickles in gets a 408 once it has waited
    body_timeout_s on the client, and the connection closes; a body that arrives in
    time on the same settings is served."""
    edge = await start_edge(nursery, _config(sim, body_timeout_s=0.3))
    body = json.dumps(chat_body("sim-echo", "slow " * 100)).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    raw = await _trickled_answer(edge, head, body)
    head_out, _, rest = raw.partition(b"\r\n\r\n")
    assert head_out.startswith(b"HTTP/1.1 408 Request Timeout"), raw
    assert b"connection: close" in head_out
    assert json.loads(rest)["error"]["code"] == "request_timeout"
    assert _errors(edge, "slow_request") == 1
    assert _errors(edge, "exception") == 0
    async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND_S) as client:
        answer = await client.post(CHAT, json=chat_body("sim-echo", "fast"), headers=AUTH)
        assert answer.status_code == 200
    await stop_edge(edge)


# --- HTTP/2 floods ---------------------------------------------------------------


async def _h2_until_closed(
    stream: trio.SocketStream, conn: h2.connection.H2Connection
) -> list[h2.events.Event]:
    """Every HTTP/2 event until the edge closes the connection."""
    events: list[h2.events.Event] = []
    with trio.fail_after(BOUND_S):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return events
            if not data:
                return events
            events += conn.receive_data(data)


def _h2_goaway(events: list[h2.events.Event]) -> h2.events.ConnectionTerminated:
    ended = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert len(ended) == 1, events
    return ended[0]


def _open_and_reset(conn: h2.connection.H2Connection, count: int, host: str) -> bytes:
    headers = [(":method", "GET"), (":path", "/healthz"), (":scheme", "http"), (":authority", host)]
    for _ in range(count):
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(stream_id, headers, end_stream=True)
        conn.reset_stream(stream_id)
    return conn.data_to_send()


async def test_h2_rapid_reset_closes_the_connection_and_others_are_served(
    edge: RunningEdge,
) -> None:
    """CVE-2023-44487: streams opened and reset at once. A burst as large as the
    concurrent streams allowed is fine (the connection still answers a PING); past
    the reset rate the edge sends GOAWAY (ENHANCE_YOUR_CALM) and closes. A stream in
    flight on another connection ends with [DONE]."""
    host = _address(edge)[0]
    in_flight = script(
        {"type": "delta", "delta": "still "}, {"sleep_ms": 100}, {"type": "delta", "delta": "here"},
        {"type": "complete", "metadata": {"finish_reason": "stop"}},
    )  # fmt: skip
    lines: list[str] = []
    async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND_S) as client:
        async with trio.open_nursery() as nursery:

            async def stream_in_flight() -> None:
                lines.extend(
                    await _stream_lines(client, chat_body("sim-script", in_flight, stream=True))
                )

            nursery.start_soon(stream_in_flight)
            conn = _h2_client()
            stream = await _open(edge)
            async with stream:
                await stream.send_all(conn.data_to_send() + _open_and_reset(conn, 100, host))
                await _h2_frames_then_ping(stream, [])
                assert _errors(edge, "h2_reset_flood") == 0
                await stream.send_all(_open_and_reset(conn, 400, host))
                goaway = _h2_goaway(await _h2_until_closed(stream, conn))
        assert goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        assert goaway.additional_data is not None
        assert b"too many HTTP/2 stream resets" in goaway.additional_data
        assert _errors(edge, "h2_reset_flood") == 1
        assert lines[-1] == "data: [DONE]"
        assert (await client.get("/healthz")).status_code == 200


async def test_h2_reads_handed_over_in_pieces_lose_nothing(edge: RunningEdge) -> None:
    """HTTP/2 bytes go to the protocol a piece at a time (a read of many small frames is
    not one step): a request body of ~300 KiB, read in 64 KiB reads cut into pieces,
    arrives whole (the echo answers it back), and a PRIORITY flood is still contained."""
    text = "".join(f"{i:07d} " for i in range(38_000))  # ~300 KB, no repeats to hide a loss
    async with httpx.AsyncClient(
        base_url=edge.url, http1=False, http2=True, timeout=BOUND_S, headers=AUTH
    ) as client:
        response = await client.post(CHAT, json=chat_body("sim-echo", text))
        assert response.http_version == "HTTP/2"
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == text
    before = _errors(edge, "exception")
    await _h2_priority_flood(edge)
    assert _errors(edge, "exception") == before + 1
    async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND_S) as client:
        assert (await client.get("/healthz")).status_code == 200


async def test_h2_frames_after_end_of_stream_count_as_resets(edge: RunningEdge) -> None:
    """ "MadeYouReset" (CVE-2025-8671): DATA on a stream the client ended makes h2
    reset it while its handler runs on. Past the reset rate such frames get GOAWAY
    (ENHANCE_YOUR_CALM) like resets do, and the edge serves other connections."""
    conn = _h2_client()
    host = _address(edge)[0]
    headers = [(":method", "GET"), (":path", "/healthz"), (":scheme", "http"), (":authority", host)]
    frames = b""
    for _ in range(300):
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(stream_id, headers, end_stream=True)
        frames += conn.data_to_send() + DataFrame(stream_id, data=b"late").serialize()
    stream = await _open(edge)
    async with stream:
        await stream.send_all(conn.data_to_send() + frames)
        goaway = _h2_goaway(await _h2_until_closed(stream, conn))
    assert goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert _errors(edge, "h2_reset_flood") == 1
    async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND_S) as client:
        assert (await client.get("/healthz")).status_code == 200


async def test_h2_header_block_past_the_list_size_is_refused_as_it_arrives(
    edge: RunningEdge,
) -> None:
    """A HEADERS frame and CONTINUATION frames that never end the block (the
    CVE-2024-27316 class): once the block passes the header list size (64 KiB) the
    edge sends GOAWAY and closes, without waiting for the end of the block."""
    conn = _h2_client()
    stream = await _open(edge)
    async with stream:
        await stream.send_all(conn.data_to_send())
        frames: list[Frame] = [HeadersFrame(1, data=b"\x00" * 16000)]
        frames += [ContinuationFrame(1, data=b"\x00" * 16000) for _ in range(5)]
        await stream.send_all(b"".join(frame.serialize() for frame in frames))
        goaway = _h2_goaway(await _h2_until_closed(stream, conn))
    assert goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert goaway.additional_data is not None
    assert b"header block larger than 65536 bytes" in goaway.additional_data
    assert _errors(edge, "bad_request") == 1


# --- the file-descriptor limit -------------------------------------------------------

_ACCEPT_FD_LINE = re.compile(r"connection closed \(accept_fd_exhausted\)")


async def _metric(url: str, name: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=BOUND_S) as client:
        text = (await client.get("/metrics")).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def test_at_the_fd_limit_accept_errors_are_a_few_lines_and_health_returns(
    tmp_path: Path, sim: SimProcess
) -> None:
    """An edge whose hard fd limit is 160, with max_connections above what that allows:
    idle connections use up every descriptor, accept() fails with EMFILE, and the edge
    logs a line a second at most (not a traceback every 100 ms), counts every failure,
    answers /healthz again once the connections are gone, and never exits."""
    toml = (
        '[server]\nlisten = "127.0.0.1:0"\nmax_connections = 1000\nidle_timeout_s = 60\n'
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
    )
    async with edge_process(tmp_path, toml, fd_limit=160) as edge:
        await edge.wait_line(r"server\.max_connections = 1000 leaves too few")
        host, port = edge.url.removeprefix("http://").rsplit(":", 1)
        held: list[trio.SocketStream] = []
        try:
            with trio.fail_after(BOUND_S):
                for _ in range(200):  # more than the edge has descriptors for
                    held.append(await trio.open_tcp_stream(host, int(port)))
            await edge.wait_line(_ACCEPT_FD_LINE.pattern)
            at_limit = trio.current_time()
            # Hold them a while: the edge keeps retrying accept() meanwhile.
            await trio.sleep(2.0)
        finally:
            for stream in held:
                await stream.aclose()
        with trio.fail_after(BOUND_S):
            while True:
                try:
                    async with httpx.AsyncClient(base_url=edge.url, timeout=2) as client:
                        if (await client.get("/healthz")).status_code == 200:
                            break
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)  # another process frees its descriptors: poll
        seconds = trio.current_time() - at_limit
        failures = await _metric(
            edge.url, 'iop_edge_connection_errors_total{kind="accept_fd_exhausted"}'
        )
        lines = [line for line in edge.lines if _ACCEPT_FD_LINE.search(line)]
        assert failures >= 1
        # A line a second at most (it used to be a traceback every 100 ms).
        assert 1 <= len(lines) <= seconds + 2, (lines, seconds)
        assert "Traceback" not in edge.stderr
        assert edge.process.poll() is None
