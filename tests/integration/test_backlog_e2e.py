"""The output held for streams, bounded in sum per process (`edge.node.backlog`).

Over real gRPC to a real node process: every way a run ends takes its buffer's
text off the backlog, once. With a real edge process: clients that stop reading
past `[timeouts] slow_client_backlog_chars` are cut, the longest stalled first,
while a client that reads is served; the backlog is empty once they are gone.
"""

from __future__ import annotations

import json
import math
import operator
import re
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.contract._proto.iop.node import v1 as pb
from edge.errors import NodeTimeoutError
from edge.node.backlog import BEYOND_BUFFER, Backlog
from edge.node.bridge import asyncio_loop
from edge.node.client import EVENT_BUFFER_CHARS, EndCause, GrpcNodeClient, NodeSocket, RunHandle
from tests.integration.conftest import SimProcess, chat_body, script
from tests.integration.edgeproc import edge_process

WAIT_S = 30.0
# 64 KiB deltas, far more of them than any buffer holds (256 MiB per run).
BIG_DELTAS = {"type": "delta", "delta": "x", "delta_times": 65536, "repeat": 4096}
HANG = {"type": "hang"}
_RUN_ID = re.compile(rb'"id":"chatcmpl-([0-9a-f]+)"')


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait, bounded, for `condition` (another task's or process's progress: polled)."""
    with trio.fail_after(WAIT_S):
        while not condition():  # noqa: ASYNC110 - no event to wait on
            await trio.sleep(0.01)


def _request(run_id: str, *events: dict[str, Any]) -> pb.RunRequest:
    content = script(*events)
    return pb.RunRequest(
        run_id=run_id, model="sim-script", messages=[pb.Message(role="user", content=content)]
    )


def _full(handle: RunHandle) -> bool:
    """The run's buffer holds all the text it may: its producer waits for room."""
    return handle.events.held_chars == EVENT_BUFFER_CHARS


async def _end_normally(client: GrpcNodeClient, nursery: trio.Nursery, backlog: Backlog) -> None:
    """The node ends the run (delta, complete); its events are never read."""
    request = _request(
        "backlog-complete", {"type": "delta", "delta": "a" * 1000}, {"type": "complete"}
    )
    handle = await client.start_run(nursery, request, deadline=math.inf)
    await handle.done.wait()
    assert handle.finished
    assert handle.cause is None


async def _node_error(client: GrpcNodeClient, nursery: trio.Nursery, backlog: Backlog) -> None:
    """The node ends the run with an error event."""
    request = _request(
        "backlog-error", {"type": "delta", "delta": "b" * 1000}, {"type": "error", "error": "boom"}
    )
    handle = await client.start_run(nursery, request, deadline=math.inf)
    await handle.done.wait()
    assert handle.finished


async def _stream_broken(client: GrpcNodeClient, nursery: trio.Nursery, backlog: Backlog) -> None:
    """The node's stream breaks without a terminal event: the run's error."""
    request = _request("backlog-abort", {"type": "delta", "delta": "c" * 1000}, {"type": "abort"})
    handle = await client.start_run(nursery, request, deadline=math.inf)
    await handle.done.wait()
    assert handle.error is not None


async def _cancelled(client: GrpcNodeClient, nursery: trio.Nursery, backlog: Backlog) -> None:
    """The edge ends a run that holds text (the drain deadline: SHUTDOWN)."""
    request = _request("backlog-cancel", {"type": "delta", "delta": "d" * 1000}, HANG)
    handle = await client.start_run(nursery, request, deadline=math.inf)
    await _until(lambda: handle.events.held_chars == 1000, "the delta buffered")
    assert backlog.chars == 1000
    handle.cancel(EndCause.SHUTDOWN)
    await handle.done.wait()


async def _aborted(client: GrpcNodeClient, nursery: trio.Nursery, backlog: Backlog) -> None:
    """The client leaves while the run's producer waits for room (full buffer)."""
    request = _request("backlog-aborted", BIG_DELTAS)
    handle = await client.start_run(nursery, request, deadline=math.inf)
    await _until(lambda: _full(handle) and backlog.waiting == 1, "the buffer full")
    handle.cancel(EndCause.CLIENT_GONE)
    await handle.done.wait()
    assert handle.cause is EndCause.CLIENT_GONE


async def _client_gone(client: GrpcNodeClient, nursery: trio.Nursery, backlog: Backlog) -> None:
    """The request's scope is cut (its nursery cancelled) while the run streams."""
    request = _request("backlog-gone", BIG_DELTAS)
    async with trio.open_nursery() as scope:
        handle = await client.start_run(scope, request, deadline=math.inf)
        await _until(lambda: _full(handle), "the buffer full")
        scope.cancel_scope.cancel()
    assert handle.cause is EndCause.CLIENT_GONE


async def _slow_client(client: GrpcNodeClient, nursery: trio.Nursery, backlog: Backlog) -> None:
    """Nobody reads for slow_consumer_s while the producer waits: SLOW_CLIENT."""
    request = _request("backlog-slow", BIG_DELTAS)
    handle = await client.start_run(nursery, request, deadline=math.inf, slow_consumer_s=0.2)
    await handle.done.wait()
    assert handle.cause is EndCause.SLOW_CLIENT
    assert not handle.events.cut_by_backlog


async def _cut(client: GrpcNodeClient, nursery: trio.Nursery, backlog: Backlog) -> None:
    """Two runs wait for room past the budget: the older is cut (SLOW_CLIENT), the newer
    keeps its place until the edge ends it."""
    older = await client.start_run(
        nursery, _request("backlog-cut-1", BIG_DELTAS), deadline=math.inf
    )
    await _until(lambda: _full(older) and backlog.waiting == 1, "the first buffer full")
    newer = await client.start_run(
        nursery, _request("backlog-cut-2", BIG_DELTAS), deadline=math.inf
    )
    await older.done.wait()
    assert older.cause is EndCause.SLOW_CLIENT
    assert older.events.cut_by_backlog
    await _until(lambda: _full(newer), "the second buffer full")
    assert not newer.done.is_set()
    assert backlog.chars == EVENT_BUFFER_CHARS
    newer.cancel(EndCause.CLIENT_GONE)
    await newer.done.wait()


async def _accept_timeout(client: GrpcNodeClient, nursery: trio.Nursery, backlog: Backlog) -> None:
    """The node does not accept in time: start_run fails, its read task over."""
    request = _request("backlog-accept", {"accept_after_ms": 5000}, {"type": "complete"})
    with pytest.raises(NodeTimeoutError):
        await client.start_run(nursery, request, deadline=math.inf, accept_s=0.05)


ENDS: dict[str, Callable[[GrpcNodeClient, trio.Nursery, Backlog], Awaitable[None]]] = {
    "complete": _end_normally,
    "node_error": _node_error,
    "stream_broken": _stream_broken,
    "cancelled": _cancelled,
    "aborted": _aborted,
    "client_gone": _client_gone,
    "slow_client": _slow_client,
    "cut": _cut,
    "accept_timeout": _accept_timeout,
}


@pytest.mark.parametrize("end", ENDS)
async def test_every_kind_of_end_takes_the_runs_text_off_the_backlog(
    sim: SimProcess, end: str
) -> None:
    """Whatever ends a run (the node, its error, a broken stream, the edge's cancel, the
    client leaving while the producer waits, the request cut, the slow-client limit, the
    budget, an accept timeout), once its read task is over the process's backlog is back
    to 0 and no producer waits, even when its writer never took the events."""
    host, port = sim.address.rsplit(":", 1)
    backlog = Backlog(EVENT_BUFFER_CHARS + EVENT_BUFFER_CHARS // 2)
    client = GrpcNodeClient("sim", NodeSocket.tcp(host, int(port)), backlog=backlog)
    async with asyncio_loop():
        try:
            with trio.fail_after(WAIT_S):
                async with trio.open_nursery() as nursery:
                    await ENDS[end](client, nursery, backlog)
                assert (backlog.chars, backlog.waiting) == (0, 0)
        finally:
            await client.aclose()
    assert backlog.cuts == (1 if end == "cut" else 0)


# --- a real edge process, clients that stop reading -------------------------------------

STALLED = 8
KEPT = 3  # streams whose buffers fit the budget
# What one stalled stream counts: its full buffer, and what it holds beyond it.
STALLED_COST = EVENT_BUFFER_CHARS + BEYOND_BUFFER
BUDGET = KEPT * STALLED_COST + EVENT_BUFFER_CHARS // 2


def _edge_toml(sim: SimProcess) -> str:
    # slow_client_s far away: only the budget ends a stalled run here.
    return (
        '[server]\nlisten = "127.0.0.1:0"\n'
        f"[timeouts]\nslow_client_s = 600\nslow_client_backlog_chars = {BUDGET}\n"
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
    )


async def _stalled_reader(url: str, body: bytes) -> tuple[trio.SocketStream, str]:
    """A client that reads its stream's first chunk (for the run id), then nothing."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket()
    # A small receive buffer: the kernel holds little, the edge feels the stall soon.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    await stream.send_all(head + body)
    received = b""
    while (match := _RUN_ID.search(received)) is None:
        chunk = await stream.receive_some(4096)
        assert chunk, f"the edge closed the connection: {received[:300]!r}"
        received += chunk
    return stream, match.group(1).decode()


async def _read_to_the_end(stream: trio.SocketStream) -> bytes:
    """Read a chunked answer to its last chunk; its last 64 KiB."""
    tail = b""
    with trio.fail_after(WAIT_S):
        while not tail.endswith(b"\r\n0\r\n\r\n"):
            chunk = await stream.receive_some(65536)
            assert chunk, f"the connection closed before the answer's end: {tail[-300:]!r}"
            tail = (tail + chunk)[-65536:]
    return tail


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


async def test_stalled_readers_past_the_budget_are_cut_oldest_first(
    tmp_path: Path, sim: SimProcess
) -> None:
    """8 clients stop reading long answers, one after another, with a budget of 3 stalled
    streams (a full buffer and what a stalled stream holds beyond it, each) and half a
    buffer: the edge cuts the 5 that stopped first (each run cancelled on the node,
    iop_edge_backlog_cuts_total 5), keeps the 3 newest, and serves a reading client
    meanwhile; the gauge never passes the budget by more than one delta per stream. Once
    the stalled clients close, the gauge is back to 0 and every run ended on the node. A cut
    client that reads again gets the end of its stream: an `overloaded` error frame."""
    body = json.dumps(
        chat_body("sim-script", script(BIG_DELTAS, {"type": "complete"}), stream=True)
    ).encode()
    highest = 0.0
    async with (
        edge_process(tmp_path, _edge_toml(sim)) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http,
    ):

        async def metrics() -> str:
            nonlocal highest
            text = (await http.get("/metrics")).text
            highest = max(highest, _metric(text, "iop_edge_backlog_chars"))
            return text

        async def until(name: str, ok: Callable[[float], bool]) -> None:
            """Wait, bounded, until the edge's metric `name` is `ok`."""
            with trio.fail_after(WAIT_S):
                while not ok(_metric(await metrics(), name)):  # noqa: ASYNC110 - another process's
                    await trio.sleep(0.05)

        streams: list[trio.SocketStream] = []
        run_ids: list[str] = []
        try:
            with trio.fail_after(WAIT_S * 2):
                for i in range(STALLED):
                    stream, run_id = await _stalled_reader(edge.url, body)
                    streams.append(stream)
                    run_ids.append(run_id)
                    # Each stalls (its buffer full) before the next starts: the order
                    # their waits began is the order they came in.
                    cut = i + 1 - KEPT
                    await until("iop_edge_backlog_cuts_total", partial(operator.le, cut))
                    full = min(i + 1, KEPT) * STALLED_COST
                    await until("iop_edge_backlog_chars", partial(operator.le, full))
                for run_id in run_ids[: STALLED - KEPT]:
                    record = await sim.wait_run(run_id, within_s=WAIT_S)
                    assert (record["outcome"], record["cancel_rpcs"]) == ("cancelled", 1)
                reply = await http.post(
                    "/v1/chat/completions", json=chat_body("sim-echo", "still served")
                )
                assert reply.status_code == 200
                assert "still served" in reply.text
                text = await metrics()
                assert _metric(text, "iop_edge_backlog_cuts_total") == STALLED - KEPT
                # The oldest reads again: what was written goes out, then the stream's end.
                tail = await _read_to_the_end(streams[0])
                assert b'"type":"overloaded"' in tail
                assert b"[DONE]" not in tail
                assert all(sim.run(run_id) is None for run_id in run_ids[STALLED - KEPT :])
        finally:
            for stream in streams:
                await stream.aclose()
        await until("iop_edge_backlog_chars", lambda n: n == 0)
        for run_id in run_ids[STALLED - KEPT :]:
            record = await sim.wait_run(run_id, within_s=WAIT_S)
            assert (record["outcome"], record["cancel_rpcs"]) == ("cancelled", 1)
        assert _metric(await metrics(), "iop_edge_backlog_cuts_total") == STALLED - KEPT
        assert edge.process.poll() is None, edge.stderr
    assert highest <= BUDGET + STALLED * 65536
    assert edge.stderr.count("(over the backlog budget)") == STALLED - KEPT
