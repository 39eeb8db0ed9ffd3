"""A run's life over a real edge and real node processes: counted once, cancelled only when
needed, nothing left behind.

- Every way a chat request can end is counted exactly once, under the right labels, with
  one log line (table-driven, three edges: timeouts, a node that dies, the rest).
- A run whose terminal event reached the edge gets no CancelRun when its client leaves:
  100 concurrent streams, half abandoned at seeded random points, and the node answers no
  CancelRun with `found: false`.
- After 1,000 abandoned streams no run, run task or stream gauge is left.

Clients are raw sockets (cheap, and they can leave at any byte). Waits are bounded polls
on in-process state or on the node's runs log; nothing asserts a duration.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import trio
from loguru import logger

from edge.config import Config, NodeConfig, ServerConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    edge_config,
    script,
    start_edge,
    start_sim,
    stop_edge,
    stop_process,
)

CHAT = "/v1/chat/completions"
HANG = {"type": "hang"}
WAIT_S = 20.0
_RUN_ID = re.compile(rb'"id":"chatcmpl-([0-9a-f]+)"')


# --- a raw HTTP/1.1 client ---------------------------------------------------------------


def _request(body: bytes, request_id: str = "", *, keep_alive: bool = False) -> bytes:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        + (f"X-Request-Id: {request_id}\r\n" if request_id else "")
        + ("" if keep_alive else "Connection: close\r\n")
        + "\r\n"
    )
    return head.encode() + body


class Client:
    """One connection to the edge, read as raw bytes."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.data = b""

    @classmethod
    async def open(cls, url: str) -> Client:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return cls(await trio.open_tcp_stream(host, int(port)))

    async def send(self, body: dict[str, Any] | bytes, request_id: str = "") -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        await self.stream.send_all(_request(raw, request_id))

    async def read_until(self, done: Callable[[bytes], bool]) -> bytes:
        with trio.fail_after(WAIT_S):
            while not done(self.data):
                chunk = await self.stream.receive_some(65536)
                if not chunk:
                    break
                self.data += chunk
        return self.data

    async def read_all(self) -> bytes:
        return await self.read_until(lambda _: False)

    def run_id(self) -> str | None:
        found = _RUN_ID.search(self.data)
        return found.group(1).decode() if found else None

    async def close(self) -> None:
        await self.stream.aclose()


# --- what the edge counted and logged ----------------------------------------------------


def gauge(edge: RunningEdge, name: str) -> float:
    value = edge.edge.metrics.registry.get_sample_value(name)
    assert value is not None
    return value


class RequestLines:
    """The edge's request lines ("chat completion ..." or "POST /v1/chat/completions ...")
    by request id, from a loguru sink."""

    def __init__(self) -> None:
        self.lines: dict[str, list[str]] = {}
        self._id = logger.add(self._sink, level="INFO", format="{message}")

    def _sink(self, message: Any) -> None:
        record = message.record
        text = record["message"]
        if text.startswith(("chat completion ", f"POST {CHAT} ")):
            self.lines.setdefault(str(record["extra"].get("request_id", "")), []).append(text)

    def close(self) -> None:
        logger.remove(self._id)


async def poll(condition: Callable[[], bool], within_s: float = WAIT_S) -> None:
    """Wait for in-process state that has no event of its own."""
    with trio.fail_after(within_s):
        while not condition():  # noqa: ASYNC110 - metrics and logs have no event
            await trio.sleep(0.01)


# --- counted once, for every way a request ends -----------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    labels: tuple[str, str, str, str]  # model, node, stream, status
    act: Callable[[RunningEdge, str], Awaitable[None]]


def _stream(*events: dict[str, Any]) -> dict[str, Any]:
    return chat_body("sim-script", script(*events), stream=True)


def answered(
    body: dict[str, Any] | bytes, status: int, *, ends: bytes = b""
) -> Callable[[RunningEdge, str], Awaitable[None]]:
    """A client that reads the whole answer: `status`, and `ends` in the body."""

    async def act(edge: RunningEdge, rid: str) -> None:
        client = await Client.open(edge.url)
        await client.send(body, rid)
        data = await client.read_all()
        await client.close()
        assert data.startswith(f"HTTP/1.1 {status} ".encode()), data[:300]
        assert ends in data, data[-300:]

    return act


async def _leave_before_accept(edge: RunningEdge, rid: str) -> None:
    """The node holds the accept back; the client hangs up while the edge waits for it."""
    client = await Client.open(edge.url)
    await client.send(_stream({"accept_after_ms": 10_000}, HANG), rid)
    await poll(lambda: any(not run.accepted for run in edge.edge.runs.live))
    await client.close()


async def _leave_mid_stream(edge: RunningEdge, rid: str) -> None:
    client = await Client.open(edge.url)
    await client.send(_stream({"type": "delta", "delta": "x"}, HANG), rid)
    await client.read_until(lambda data: b'"content":"x"' in data)
    await client.close()


async def _leave_before_first_byte(edge: RunningEdge, rid: str) -> None:
    """The run is accepted; the client hangs up without reading a byte."""
    client = await Client.open(edge.url)
    await client.send(_stream(HANG), rid)
    await poll(lambda: any(run.accepted for run in edge.edge.runs.live))
    await client.close()


async def _non_stream_disconnect(edge: RunningEdge, rid: str) -> None:
    client = await Client.open(edge.url)
    await client.send(chat_body("sim-script", script({"type": "delta", "delta": "x"}, HANG)), rid)
    await poll(lambda: any(run.reader.first_event_at for run in edge.edge.runs.live))
    await client.close()


async def _drain(edge: RunningEdge, rid: str) -> None:
    """A stream still running when the edge shuts down: a notice frame, counted cancelled."""
    client = await Client.open(edge.url)
    await client.send(_stream({"type": "delta", "delta": "x"}, HANG), rid)
    await client.read_until(lambda data: b'"content":"x"' in data)
    edge.edge.shutdown.set()
    data = await client.read_all()
    await client.close()
    assert b'"type":"service_unavailable"' in data


ECHO = chat_body("sim-echo", "hello there")
TIMEOUT_CASES = [
    Case("accept timeout", ("sim-script", "sim", "true", "timeout"),
         answered(_stream({"accept_after_ms": 10_000}, HANG), 504)),
    Case("idle timeout", ("sim-script", "sim", "true", "timeout"),
         answered(_stream({"type": "delta", "delta": "a"}, HANG), 200,
                  ends=b'"type":"timeout"')),
    Case("total timeout", ("sim-script", "sim", "true", "timeout"),
         answered(_stream(*[{"sleep_ms": 150}, {"type": "delta", "delta": "b"}] * 40), 200,
                  ends=b"timed out waiting for the run to finish")),
]  # fmt: skip
DYING_NODE_CASES = [
    Case("node refuses", ("sim-echo", "doomed", "false", "error"), answered(ECHO, 503)),
    # Marked down, it is still the only node for the model: panic routing tries it again.
    Case("node down", ("sim-echo", "doomed", "false", "error"), answered(ECHO, 503)),
]
CASES = [
    Case("parse error", ("unknown", "none", "false", "error"), answered(b"{nope", 400)),
    Case("unknown model", ("unknown", "none", "false", "error"),
         answered(chat_body("no-such-model", "hi"), 404)),
    Case("client leaves before accept", ("sim-script", "sim", "true", "cancelled"),
         _leave_before_accept),
    Case("client leaves before first byte", ("sim-script", "sim", "true", "cancelled"),
         _leave_before_first_byte),
    Case("client leaves mid-stream", ("sim-script", "sim", "true", "cancelled"),
         _leave_mid_stream),
    Case("non-stream disconnect", ("sim-script", "sim", "false", "cancelled"),
         _non_stream_disconnect),
    Case("node error", ("sim-script", "sim", "true", "error"),
         answered(_stream({"type": "delta", "delta": "x"}, {"type": "error", "error": "boom"}),
                  200, ends=b'"type":"run_error"')),
    Case("node stream breaks", ("sim-script", "sim", "false", "error"),
         answered(chat_body("sim-script", script({"type": "delta", "delta": "x"},
                                                 {"type": "abort"})), 502)),
    Case("complete", ("sim-echo", "sim", "true", "success"),
         answered({**ECHO, "stream": True}, 200, ends=b"data: [DONE]\n\n")),
    Case("complete, not streamed", ("sim-echo", "sim", "false", "success"), answered(ECHO, 200)),
    Case("drain", ("sim-script", "sim", "true", "cancelled"), _drain),
]  # fmt: skip


async def _run_cases(edge: RunningEdge, cases: list[Case], lines: RequestLines) -> None:
    """Each case, one at a time: exactly one count under its labels, one request line."""
    for i, case in enumerate(cases):
        before = edge.requests()
        rid = f"case-{i}-{case.name.replace(' ', '-').replace(',', '')}"
        await case.act(edge, rid)
        counted = sum(before.values())
        await poll(lambda: sum(edge.requests().values()) > counted)  # noqa: B023
        await edge.wait_idle()
        after = edge.requests()
        changed = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        assert changed == {case.labels: 1}, (case.name, changed)
        assert len(lines.lines.get(rid, [])) == 1, (case.name, lines.lines.get(rid))
        assert gauge(edge, "iop_edge_active_streams") == 0, case.name


async def test_every_way_a_request_ends_is_counted_once(
    nursery: trio.Nursery, sim: SimProcess, tmp_path: Any
) -> None:
    """Parse error, unknown model, a node that refuses, a node down, an accept timeout, a
    client leaving before the accept, before the first byte, mid-stream or before a
    non-streamed answer, idle and total timeouts, a node error, a broken node stream,
    complete answers and a drain: each request is counted exactly once, under the right
    labels, with one request line in the log, and no stream is left open."""
    lines = RequestLines()
    try:
        timeouts = await start_edge(
            nursery, edge_config(sim, first_event_s=0.5, idle_s=0.5, total_s=1.0)
        )
        await _run_cases(timeouts, TIMEOUT_CASES, lines)
        await stop_edge(timeouts)

        doomed = start_sim(tmp_path, "doomed")
        try:
            config = Config(
                server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0, node_refresh_s=600),
                nodes=(NodeConfig("doomed", doomed.address),),
            )
            dying = await start_edge(nursery, config)
        finally:
            stop_process(doomed.process)  # the edge still thinks it is up
        await _run_cases(dying, DYING_NODE_CASES, lines)
        await stop_edge(dying)

        config = edge_config(sim)
        config = replace(config, server=replace(config.server, drain_timeout_s=0.2))
        edge = await start_edge(nursery, config)
        await _run_cases(edge, CASES, lines)
    finally:
        lines.close()


# --- no needless CancelRun ----------------------------------------------------------------


def _terminal_at_edge(edge: RunningEdge, run_id: str) -> bool:
    """The edge's read task of `run_id` has the node's terminal event (or the run is over)."""
    for run in edge.edge.runs.live:
        if run.info.run_id == run_id:
            return run.reader.handle is not None and run.reader.handle.events.terminal
    return True


async def test_a_run_whose_terminal_reached_the_edge_gets_no_cancel(
    edge: RunningEdge, sim: SimProcess
) -> None:
    """100 concurrent streams of 40 deltas; half the clients leave at seeded random points
    (after 1 to 42 frames) once the node's terminal event has reached the edge, whether or
    not the edge has written it yet: none of those runs gets a CancelRun (the node would
    answer `found: false`, as it had ended them)."""
    rng = random.Random(12)
    half = [i % 2 == 0 for i in range(100)]
    rng.shuffle(half)
    deltas = [{"type": "delta", "delta": f"d{i} "} for i in range(40)]
    body = _stream(*deltas, {"type": "complete"})
    run_ids: list[str] = []

    async def one(abandon: bool, frames: int) -> None:
        client = await Client.open(edge.url)
        await client.send(body)
        if abandon:  # role, 40 deltas, finish: leave after `frames` of them
            await client.read_until(lambda data: data.count(b"data: ") >= frames)
            run_id = client.run_id()
            assert run_id is not None
            with trio.fail_after(WAIT_S):
                while not _terminal_at_edge(edge, run_id):  # noqa: ASYNC110 - no event
                    await trio.sleep(0.001)
        else:
            await client.read_until(lambda data: b"data: [DONE]" in data)
        run_id = client.run_id()
        assert run_id is not None
        run_ids.append(run_id)
        await client.close()

    async with trio.open_nursery() as clients:
        for abandon in half:
            clients.start_soon(one, abandon, rng.randint(1, 42))
    await edge.wait_idle(within_s=60)
    records = [await sim.wait_run(run_id, within_s=WAIT_S) for run_id in run_ids]
    assert [r["outcome"] for r in records] == ["complete"] * 100
    assert [r["cancel_rpcs"] for r in records] == [0] * 100
    ours = set(run_ids)
    needless = [r for r in sim.runs() if r.get("type") == "cancel_rpc" and r["run_id"] in ours]
    assert needless == []


# --- nothing left behind ------------------------------------------------------------------


def _live_tasks() -> int:
    """Every task of this trio run, counted through the nursery tree."""
    count = 0
    pending = [trio.lowlevel.current_root_task()]
    while pending:
        task = pending.pop()
        count += 1
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return count


async def test_no_run_or_task_is_left_after_a_thousand_abandoned_streams(
    edge: RunningEdge,
) -> None:
    """1,000 streams abandoned right after their first frame, 50 at a time: afterwards no
    run is in flight, `iop_edge_active_streams` is 0, and the trio run has exactly as many
    tasks as before, or fewer (each request's nursery and read task ended with it)."""
    warm = await Client.open(edge.url)
    await warm.send(ECHO)
    await warm.read_all()
    await warm.close()
    await edge.wait_idle()
    baseline = _live_tasks()
    body = _stream({"type": "delta", "delta": "x"}, HANG)
    limiter = trio.CapacityLimiter(50)

    async def one() -> None:
        async with limiter:
            client = await Client.open(edge.url)
            await client.send(body)
            await client.read_until(lambda data: b"data: " in data)
            await client.close()

    async with trio.open_nursery() as clients:
        for _ in range(1000):
            clients.start_soon(one)
    await edge.wait_idle(within_s=60)
    assert not edge.edge.runs.live
    assert gauge(edge, "iop_edge_active_streams") == 0
    await poll(lambda: _live_tasks() <= baseline)
