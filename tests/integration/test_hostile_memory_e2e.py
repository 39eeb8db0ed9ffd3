"""End to end: memory per stream is bounded in bytes, whatever a client or a node does.

Real processes and sockets throughout: an `iop-edge` subprocess (its RSS read
with psutil) in front of the `iop-sim-node` subprocess; clients on raw
sockets that stop reading; a node that sends a message over gRPC's 4 MiB
limit; and `iop-node` (a subprocess) in front of a hostile upstream that
sends an endless non-streamed body, endless tool-call arguments or an
endless SSE line. What a refused message leaves behind is traced in this
process, the garbage collector off. The RSS bounds are generous (a few times what the bounded
buffers hold, far under what unbounded growth reaches); no test reads a clock.
"""

from __future__ import annotations

import gc
import json
import re
import socket
import tracemalloc
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import h11
import httpx
import psutil  # type: ignore[import-untyped]
import pytest
import trio

from edge.contract._proto.iop.node import v1 as pb
from edge.node.bridge import asyncio_loop
from edge.node.client import GrpcNodeClient, NodeSocket
from edge.stream.events import Failed, NodeEvent
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    edge_config,
    node_events,
    script,
    start_edge,
    start_upstream_node,
    stop_edge,
    stop_process,
)
from tests.integration.edgeproc import edge_process
from tests.integration.rawhttp import read_request, send_events, serve_upstream

MiB = 1024 * 1024
WAIT_S = 60.0
STALLED_CLIENTS = 20
# 64 KiB deltas, far more of them than any buffer holds (256 MiB per stream).
BIG_DELTAS = {"type": "delta", "delta": "x", "delta_times": 65536, "repeat": 4096}
_RUN_ID = re.compile(rb'"id":"chatcmpl-([0-9a-f]+)"')


def _edge_toml(sim: SimProcess) -> str:
    # A small slow_client_s, so the runs of clients that stopped reading end soon.
    return (
        '[server]\nlisten = "127.0.0.1:0"\n'
        "[timeouts]\nslow_client_s = 1.0\n"
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
    )


class RssPeak:
    """The highest RSS of a process, sampled every 20 ms until `stop`."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self.base = self.peak = self._process.memory_info().rss
        self._done = trio.Event()

    async def watch(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            with trio.move_on_after(0.02):
                await self._done.wait()

    def stop(self) -> int:
        """Stop sampling; the growth over the RSS when the watch began, in bytes."""
        self.peak = max(self.peak, self._process.memory_info().rss)
        self._done.set()
        return self.peak - self.base


def _post(url: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    host = url.removeprefix("http://")
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


async def _stalled_reader(url: str, body: dict[str, Any]) -> tuple[trio.SocketStream, str]:
    """A client that reads its stream's first chunk (for the run id), then nothing."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket()
    # A small receive buffer: the kernel holds little, the edge feels the stall soon.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    await stream.send_all(_post(url, body))
    received = b""
    while (match := _RUN_ID.search(received)) is None:
        chunk = await stream.receive_some(4096)
        assert chunk, f"the edge closed the connection: {received[:300]!r}"
        received += chunk
    return stream, match.group(1).decode()


async def stalled_readers_growth(
    tmp: Path, sim: SimProcess, *, clients: int = STALLED_CLIENTS, env: Mapping[str, str] = {}
) -> int:
    """The edge's RSS growth while `clients` stop reading streams of 64 KiB deltas.

    Returns once every run has ended on the node (cancelled: slow_client).
    """
    body = chat_body("sim-script", script(BIG_DELTAS, {"type": "complete"}), stream=True)
    async with edge_process(tmp, _edge_toml(sim), env=env) as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as warm:  # imports, pools
            small = chat_body("sim-echo", "warm up", stream=True)
            async with warm.stream("POST", "/v1/chat/completions", json=small) as response:
                assert response.status_code == 200
                await response.aread()
        rss = RssPeak(edge.process.pid)
        streams: list[trio.SocketStream] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rss.watch)
            try:
                with trio.fail_after(WAIT_S):
                    run_ids = []
                    for _ in range(clients):
                        stream, run_id = await _stalled_reader(edge.url, body)
                        streams.append(stream)
                        run_ids.append(run_id)
                    for run_id in run_ids:
                        record = await sim.wait_run(run_id, within_s=WAIT_S)
                        assert record["outcome"] == "cancelled", record
                        assert record["cancel_rpc"], record
            finally:
                growth = rss.stop()
                for stream in streams:
                    await stream.aclose()
        assert edge.process.poll() is None, edge.stderr
    return growth


async def test_stalled_readers_hold_bounded_memory(tmp_path: Path, sim: SimProcess) -> None:
    """20 clients that stop reading 64 KiB-delta streams cost the edge a bounded amount
    each (its event buffer, one batch, the node's stream window), not their answers: RSS
    grows well under 100 MiB (it grew by ~660 MiB when the buffer was bounded by count), and
    every run ends on the node, cancelled by the edge."""
    growth = await stalled_readers_growth(tmp_path, sim)
    print(f"edge RSS growth, {STALLED_CLIENTS} stalled readers: {growth / MiB:.1f} MiB")
    assert growth < 100 * MiB


async def big_answer_growth(
    tmp: Path, sim: SimProcess, *, deltas: int = 512, env: Mapping[str, str] = {}
) -> int:
    """The edge's RSS growth while one client reads a streamed answer of `deltas` x 64 KiB."""
    item = {**BIG_DELTAS, "repeat": deltas}
    body = chat_body("sim-script", script(item, {"type": "complete"}), stream=True)
    async with (
        edge_process(tmp, _edge_toml(sim), env=env) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as client,
    ):
        small = chat_body("sim-echo", "warm up", stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=small) as response:
            await response.aread()
        rss = RssPeak(edge.process.pid)
        received = 0
        tail = b""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rss.watch)
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    async for chunk in response.aiter_bytes():
                        received += len(chunk)
                        tail = (tail + chunk)[-64:]
            finally:
                growth = rss.stop()
        assert tail.endswith(b"data: [DONE]\n\n"), tail
        assert received > deltas * 65536
    return growth


async def test_big_answer_is_not_kept(tmp_path: Path, sim: SimProcess) -> None:
    """A client reading a 32 MiB streamed answer: the edge keeps none of it once written
    (it kept two copies before), so its RSS grows by far less than the answer."""
    growth = await big_answer_growth(tmp_path, sim)
    print(f"edge RSS growth, one reader of a 32 MiB answer: {growth / MiB:.1f} MiB")
    assert growth < 24 * MiB


# --- a node that sends a message over the gRPC limit ---------------------------------


OVERSIZED = {"type": "delta", "delta": "x", "delta_times": 5 * MiB}


async def test_oversized_grpc_message_is_a_node_failure(
    edge: RunningEdge, http: httpx.AsyncClient
) -> None:
    """A RunEvent over 4 MiB ends the stream with an error frame naming the limit (after
    what came before it), the non-streaming answer is a 502 JSON error, and the edge
    serves the next request."""
    events = script({"type": "delta", "delta": "before"}, OVERSIZED, {"type": "complete"})
    frames = []
    async with http.stream(
        "POST", "/v1/chat/completions", json=chat_body("sim-script", events, stream=True)
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                frames.append(line.removeprefix("data: "))
    assert '"content":"before"' in frames[1]
    error = json.loads(frames[-1])["error"]
    assert "4194304-byte gRPC message limit" in error["message"]
    assert error["type"] == "run_error"

    answer = await http.post("/v1/chat/completions", json=chat_body("sim-script", events))
    assert answer.status_code == 502
    assert "gRPC message limit" in answer.json()["error"]["message"]

    ok = await http.post("/v1/chat/completions", json=chat_body("sim-echo", "still here"))
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["message"]["content"] == "still here"


def _traced() -> int:
    return tracemalloc.get_traced_memory()[0]


async def test_oversized_messages_are_freed_without_a_collection(
    edge: RunningEdge, http: httpx.AsyncClient
) -> None:
    """The edge keeps nothing of a node's oversized message once its run failed: with the
    garbage collector off, four such runs (streamed and not, through the real edge in this
    process) leave less than one message traced. Before, each error's traceback held the
    frames holding the message, tied into a cycle by the run handle's stored error: only a
    full collection freed them (RSS stayed 270-400 MB up through thousands of requests)."""
    events = script({"type": "delta", "delta": "before"}, OVERSIZED, {"type": "complete"})
    for stream in (False, True):  # warm up: imports, pools, first-use caches
        await http.post("/v1/chat/completions", json=chat_body("sim-script", events, stream=stream))
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = _traced()
        for stream in (False, True, False, True):
            body = chat_body("sim-script", events, stream=stream)
            answer = await http.post("/v1/chat/completions", json=body)
            assert "4194304-byte gRPC message limit" in answer.text
        await edge.wait_idle()
        held = _traced() - base
    finally:
        tracemalloc.stop()
        gc.enable()
    print(f"traced after four oversized messages, no collection: {held / MiB:.2f} MiB")
    assert held < 5 * MiB


async def test_oversized_messages_leave_no_rss_behind(tmp_path: Path, sim: SimProcess) -> None:
    """An `iop-edge` process whose node sends eight 16 MiB messages (the largest a sim-script
    builds) keeps none of them: RSS grows by the allocator's high-water mark of about one
    message, not by the messages (it grew by ~100 MiB a message, 80 MiB ones, kept through
    thousands of requests)."""
    big = {"type": "delta", "delta": "x", "delta_times": 16 * MiB - 64}
    events = script({"type": "delta", "delta": "before"}, big, {"type": "complete"})
    async with (
        edge_process(tmp_path, _edge_toml(sim)) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as client,
    ):
        for _ in range(20):  # warm up
            ok = await client.post("/v1/chat/completions", json=chat_body("sim-echo", "warm"))
            assert ok.status_code == 200
        process = psutil.Process(edge.process.pid)
        base = process.memory_info().rss
        for i in range(8):
            body = chat_body("sim-script", events, stream=bool(i % 2))
            answer = await client.post("/v1/chat/completions", json=body)
            assert "gRPC message limit" in answer.text
        growth = process.memory_info().rss - base
    print(f"edge RSS growth, eight 16 MiB messages refused: {growth / MiB:.1f} MiB")
    assert growth < 56 * MiB


async def test_request_over_the_grpc_limit_is_a_413(nursery: trio.Nursery, sim: SimProcess) -> None:
    """With max_body_bytes raised past 4 MiB, a request whose RunRequest would pass the
    nodes' gRPC message limit is refused with a 413 naming that limit (not a node failure)."""
    config = edge_config(sim)
    config = replace(config, server=replace(config.server, max_body_bytes=8 * MiB))
    running = await start_edge(nursery, config)
    try:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
            body = chat_body("sim-echo", "y" * (5 * MiB))
            answer = await client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 413
            assert "gRPC message limit" in answer.json()["error"]["message"]
            ok = await client.post("/v1/chat/completions", json=chat_body("sim-echo", "fine"))
            assert ok.status_code == 200
    finally:
        await stop_edge(running)


# --- iop-node in front of a hostile upstream ------------------------------------------

# What the hostile upstream sends at most (it stops sooner when the node hangs up).
HOSTILE_BYTES = 512 * MiB
PIECE = b"x" * 65536


class HostileUpstream:
    """An OpenAI-compatible server whose answers never end (model = how).

    `huge-body`: a non-streamed JSON answer whose content never ends;
    `endless-args`: an SSE stream of one tool call whose arguments never end;
    `endless-line`: an SSE `data:` line that never ends. Each stops at
    HOSTILE_BYTES or when the client goes away (`hung_up`).
    """

    def __init__(self) -> None:
        self.url = ""
        self.hung_up = trio.Event()
        self.sent = 0

    async def serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                received = await read_request(stream, conn)
                assert received is not None
                request, body = received
                if request.target.endswith(b"/models"):
                    data = json.dumps({"data": [{"id": "huge-body"}]}).encode()
                    headers = [
                        ("content-type", "application/json"),
                        ("content-length", str(len(data))),
                    ]
                    await self._send(stream, conn, h11.Response(status_code=200, headers=headers))
                    await self._send(stream, conn, h11.Data(data), h11.EndOfMessage())
                    return
                await self._answer(stream, conn, json.loads(body)["model"])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.hung_up.set()

    async def _send(self, stream: trio.SocketStream, conn: h11.Connection, *events: Any) -> None:
        self.sent += await send_events(stream, conn, *events)

    async def _answer(self, stream: trio.SocketStream, conn: h11.Connection, how: str) -> None:
        kind = "application/json" if how == "huge-body" else "text/event-stream"
        head_event = h11.Response(status_code=200, headers=[("content-type", kind)])
        await self._send(stream, conn, head_event)
        if how == "huge-body":
            head = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"'
        elif how == "endless-args":
            call = {"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}
            first = {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}
            head = f"data: {json.dumps(first)}\n\n".encode()
        else:
            head = b'data: {"choices":[{"index":0,"delta":{"content":"'
        await self._send(stream, conn, h11.Data(head))
        fragment = {"index": 0, "function": {"arguments": PIECE.decode()}}
        chunk = {"choices": [{"index": 0, "delta": {"tool_calls": [fragment]}}]}
        piece = f"data: {json.dumps(chunk)}\n\n".encode() if how == "endless-args" else PIECE
        while self.sent < HOSTILE_BYTES:
            await self._send(stream, conn, h11.Data(piece))
        # Not reached when the node enforces its limits: the node hangs up first.


async def _node_events(port: int, model: str, nursery: trio.Nursery) -> list[NodeEvent]:
    client = GrpcNodeClient("node", NodeSocket.tcp("127.0.0.1", port))
    request = pb.RunRequest(
        run_id="hostile1", model=model, messages=[pb.Message(role="user", content="hi")]
    )
    try:
        with trio.fail_after(WAIT_S):
            handle = await client.start_run(nursery, request, deadline=trio.current_time() + WAIT_S)
            return await node_events(handle)
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("how", "limit"),
    [
        ("huge-body", "exceeds the node's limit of 16777216 bytes"),
        ("endless-args", "tool calls exceed 524288 characters"),
        ("endless-line", "a line of over 8388608 characters"),
    ],
)
async def test_iop_node_caps_what_it_reads_from_an_upstream(
    tmp_path: Path, nursery: trio.Nursery, how: str, limit: str
) -> None:
    """iop-node reads an upstream's answer only up to its caps: past one, the run's terminal
    is an error event naming the limit, the upstream request is closed, and the node's RSS
    stays bounded (it peaked at 1.7-1.9 GB when it read without limits)."""
    upstream = HostileUpstream()
    url = await serve_upstream(nursery, upstream.serve)
    node = start_upstream_node(tmp_path / "runs.jsonl", url)
    try:
        port = int(node.address.rsplit(":", 1)[1])
        rss = RssPeak(node.process.pid)
        nursery.start_soon(rss.watch)
        try:
            async with asyncio_loop():
                events = await _node_events(port, how, nursery)
        finally:
            growth = rss.stop()
        with trio.fail_after(WAIT_S):
            await upstream.hung_up.wait()
    finally:
        stop_process(node.process)
    print(f"iop-node RSS growth, {how}: {growth / MiB:.1f} MiB")
    assert isinstance(events[-1], Failed), events[-1]
    assert limit in events[-1].reason
    assert upstream.sent < HOSTILE_BYTES
    assert growth < 200 * MiB
