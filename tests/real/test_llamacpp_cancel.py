"""The cancel path against llama.cpp's real server: every way a run ends stops the
generation, whichever hop the run crosses.

A slot generating for nobody is GPU time lost, and it holds the slot from the next
request. The check is the server's own: its `/slots` say no slot is processing within
IDLE_WITHIN_S of the run's end, and no connection of the node's to it has bytes waiting
unread (`ss`: what a connection left open in a pool, its answer still coming, shows).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import trio

from edge.config import Config, NodeConfig, ServerConfig, TimeoutsConfig
from tests.integration.conftest import RunningEdge, SimProcess, start_edge, stop_edge
from tests.real.llamacpp import MODEL_NAME, LlamaServer, unread_bytes

# From a run's end on the edge to the server's slot idle: the close's way across two
# loopback hops and the server's check between two tokens, with room for a busy machine.
IDLE_WITHIN_S = 1.0
DISCONNECTS = 100


@pytest.fixture(params=["iop-node", "openai+http"])
def address(request: pytest.FixtureRequest, llama: LlamaServer, iop_node: SimProcess) -> str:
    """The node: iop-node as a process (CancelRun and the stream's reset race there), or
    the edge relaying to llama-server itself."""
    return iop_node.address if request.param == "iop-node" else f"openai+{llama.url}"


def _config(address: str, **timeouts: float) -> Config:
    return Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0, drain_timeout_s=0.3),
        timeouts=replace(TimeoutsConfig(), **timeouts),
        nodes=(NodeConfig("llama", address),),
    )


@pytest.fixture
async def edge(nursery: trio.Nursery, address: str) -> AsyncIterator[RunningEdge]:
    running = await start_edge(nursery, _config(address))
    yield running
    await stop_edge(running)


def _body(max_tokens: int = 2000) -> bytes:
    body = {
        "model": MODEL_NAME, "stream": True, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Write a long story about the sea."}],
    }  # fmt: skip
    return json.dumps(body).encode()


async def _stream_then_leave(url: str, frames: int | None) -> None:
    """POST a streamed chat request, read `frames` SSE frames of its answer (0: none, not
    even the head; None: to its end, whoever ends it), and close the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = _body()
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        seen = b""
        while frames is None or seen.count(b"data: ") < frames:
            data = await stream.receive_some(65536)
            if not data:
                assert frames is None, "the answer ended before the client left"
                return
            seen += data
            if frames is None and seen.endswith(b"\r\n0\r\n\r\n"):
                return  # the answer's end (its connection kept alive)


async def _idle(llama: LlamaServer, what: str) -> None:
    """The server's slots are all idle within IDLE_WITHIN_S (asked in a thread)."""
    with trio.move_on_after(IDLE_WITHIN_S):
        while await trio.to_thread.run_sync(llama.busy_slots):  # noqa: ASYNC110 - a server's
            await trio.sleep(0.01)
        return
    raise AssertionError(f"{what}: llama-server still generating {IDLE_WITHIN_S:g}s later")


async def _drained(pid: int, port: int, what: str) -> None:
    """No connection of `pid` to the server holds unread bytes within IDLE_WITHIN_S: one
    being closed as its run ends may still hold the server's last bytes for a moment; one
    left open in a pool, its answer unread, holds them for good."""
    with trio.move_on_after(IDLE_WITHIN_S):
        while any(await trio.to_thread.run_sync(unread_bytes, pid, port)):  # noqa: ASYNC110 - ss
            await trio.sleep(0.01)
        return
    raise AssertionError(f"{what}: an answer left unread {IDLE_WITHIN_S:g}s later")


def _node_pid(address: str, iop_node: SimProcess) -> int:
    """The process whose connections reach llama-server: iop-node's, or this one."""
    return iop_node.process.pid if not address.startswith("openai+") else os.getpid()


async def test_disconnects_at_random_points_stop_the_generation(
    edge: RunningEdge, llama: LlamaServer, address: str, iop_node: SimProcess
) -> None:
    """DISCONNECTS clients leave their streamed answers at random points (before its head,
    after a token, deep in it): after each, the server stops generating within
    IDLE_WITHIN_S, and no connection to it is left holding an answer nobody reads."""
    rng = random.Random(40)
    pid = _node_pid(address, iop_node)
    for n in range(DISCONNECTS):
        frames = rng.choice([0, 1, 2, rng.randrange(3, 30), rng.randrange(30, 300)])
        with trio.fail_after(60):
            await _stream_then_leave(edge.url, frames)
            await edge.wait_idle()
        await _idle(llama, f"disconnect {n} after {frames} frames")
        await _drained(pid, llama.port, f"disconnect {n} after {frames} frames")


async def test_timeouts_stop_the_generation(
    nursery: trio.Nursery, llama: LlamaServer, address: str
) -> None:
    """Runs that reach the edge's total time end as timeouts for their clients, and the
    server stops generating theirs: two at a time (the server's slots), four rounds."""
    running = await start_edge(nursery, _config(address, total_s=0.4))
    for round_ in range(4):
        async with trio.open_nursery() as clients:
            for _ in range(2):
                clients.start_soon(_stream_then_leave, running.url, None)
        await running.wait_idle()
        await _idle(llama, f"timeout round {round_}")
    statuses = {(o.status, o.error_type, o.node_status) for _, o in running.outcomes}
    assert {s for s, _, _ in statuses} == {"timeout"}, statuses
    await stop_edge(running)


async def test_drain_stops_the_generation(
    nursery: trio.Nursery, llama: LlamaServer, address: str
) -> None:
    """An edge that stops with answers streaming (its drain deadline past) ends their runs,
    and the server stops generating them."""
    running = await start_edge(nursery, _config(address))
    async with trio.open_nursery() as clients:
        for _ in range(2):
            clients.start_soon(_stream_then_leave, running.url, None)
        with trio.fail_after(30):
            while len(await trio.to_thread.run_sync(llama.busy_slots)) < 2:  # noqa: ASYNC110
                await trio.sleep(0.02)
        running.edge.shutdown.set()
    await _idle(llama, "drain")
