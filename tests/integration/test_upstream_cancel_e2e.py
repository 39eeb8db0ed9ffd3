"""Every way a run through iop-node ends closes its upstream request: a model server
generates for nobody only as long as it takes the close to reach it.

The upstream here is a real socket server that streams a long answer, a chunk a
millisecond, until its client closes the connection, and counts the requests it is
still answering. iop-node runs as a process in front of it and an edge in front of
iop-node, so a client's disconnect crosses HTTP, gRPC (the stream reset and CancelRun,
which race) and iop-node's relay as in a deployment. `make real` runs the same
checks against llama.cpp's own server (tests/real).
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import h11
import pytest
import trio

from edge.config import Config, NodeConfig, ServerConfig, TimeoutsConfig
from tests.integration.conftest import (
    poll,
    start_edge,
    start_upstream_node,
    stop_edge,
    stop_process,
)
from tests.integration.rawhttp import read_request, send_events, send_whole, serve_upstream

# How long a request may go on upstream after its run ended: the close's way across
# the loopback, with room for a loaded machine.
CLOSED_WITHIN_S = 5.0
# The chunks of an answer nobody stops (a minute of them, a millisecond apart).
ANSWER_CHUNKS = 60_000


@dataclass
class Generator:
    """An upstream whose every chat request streams until its client goes away."""

    url: str = ""
    # Requests being answered now, and every one answered so far.
    live: int = 0
    started: int = 0
    # Chunks written to requests whose client had already gone (a leak feeds these).
    changed: trio.Event = field(default_factory=trio.Event)

    def tick(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


def _chunk(i: int) -> bytes:
    delta = {"content": f"w{i} "}
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


async def _answer(stream: trio.SocketStream, conn: h11.Connection) -> None:
    """Stream chunks until the client closes (end of file, or a write that fails)."""
    head = h11.Response(status_code=200, headers=[("content-type", "text/event-stream")])
    async with trio.open_nursery() as nursery:

        async def hang_up() -> None:
            try:
                while await stream.receive_some(65536):
                    pass
            except trio.BrokenResourceError:
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(hang_up)
        try:
            await send_events(stream, conn, head)
            for i in range(ANSWER_CHUNKS):
                await send_events(stream, conn, h11.Data(_chunk(i)))
                await trio.sleep(0.001)
            await send_events(stream, conn, h11.Data(b"data: [DONE]\n\n"), h11.EndOfMessage())
        except trio.BrokenResourceError:
            pass  # the client went away
        nursery.cancel_scope.cancel()


async def _connection(upstream: Generator, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    async with stream:
        try:
            while (received := await read_request(stream, conn)) is not None:
                request, _ = received
                if request.target.endswith(b"/models"):
                    data = [{"id": "gen", "object": "model", "owned_by": "test"}]
                    await send_whole(stream, conn, 200, json.dumps({"data": data}).encode())
                elif request.target.endswith(b"/chat/completions"):
                    upstream.live += 1
                    upstream.started += 1
                    upstream.tick()
                    try:
                        await _answer(stream, conn)
                    finally:
                        upstream.live -= 1
                        upstream.tick()
                    return
                else:
                    await send_whole(stream, conn, 404, b"{}")
                conn.start_next_cycle()
        except (trio.BrokenResourceError, h11.ProtocolError):
            return


@pytest.fixture
async def generator(nursery: trio.Nursery) -> Generator:
    upstream = Generator()
    upstream.url = await serve_upstream(nursery, partial(_connection, upstream))
    return upstream


@pytest.fixture(params=["iop-node", "openai+http"])
async def node_address(
    request: pytest.FixtureRequest, generator: Generator, tmp_path: Path
) -> AsyncIterator[str]:
    """The node in front of the generator: iop-node as a process (the gRPC hop, where
    CancelRun and the stream's reset race), or the edge relaying to it itself."""
    if request.param == "openai+http":
        yield f"openai+{generator.url}"
        return
    node = await trio.to_thread.run_sync(
        partial(start_upstream_node, tmp_path / "runs.jsonl", generator.url, "--models", "gen")
    )
    yield node.address
    await trio.to_thread.run_sync(stop_process, node.process)


def _config(address: str, drain_timeout_s: float = 30.0, **timeouts: float) -> Config:
    return Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0, drain_timeout_s=drain_timeout_s),
        timeouts=replace(TimeoutsConfig(), **timeouts),
        nodes=(NodeConfig("node", address),),
    )


async def _stream_then_leave(url: str, chunks: int | None) -> None:
    """POST a streamed chat request, read `chunks` of its answer's frames (0: none, not
    even the head; None: to the answer's end, whenever the edge ends it), and close the
    connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {"model": "gen", "stream": True, "messages": [{"role": "user", "content": "go"}]}
    ).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        seen = b""
        while chunks is None or seen.count(b"data: ") < chunks:
            data = await stream.receive_some(65536)
            if not data and chunks is None:
                return
            assert data, "the answer ended before the client left"
            seen += data
            if chunks is None and seen.endswith(b"\r\n0\r\n\r\n"):
                return  # the answer's end (its connection kept alive)


async def _upstream_idle(upstream: Generator) -> None:
    with trio.fail_after(CLOSED_WITHIN_S):
        while upstream.live:
            await upstream.changed.wait()


async def test_disconnects_at_random_points_close_every_upstream_request(
    nursery: trio.Nursery, generator: Generator, node_address: str
) -> None:
    """Clients that leave at random points of their answer (before its head, after a
    few chunks, deep in it), one after another: each one's upstream request is closed
    within CLOSED_WITHIN_S of its run's end on the edge, and no request is left open."""
    running = await start_edge(nursery, _config(node_address))
    rng = random.Random(40)
    for n in range(60):
        chunks = rng.choice([0, 1, 2, rng.randrange(3, 40), rng.randrange(40, 400)])
        with trio.fail_after(30):
            await _stream_then_leave(running.url, chunks)
            await running.wait_idle()
        try:
            await _upstream_idle(generator)
        except trio.TooSlowError:
            raise AssertionError(
                f"disconnect {n} after {chunks} chunks left its request open"
            ) from None
    await stop_edge(running)


async def test_concurrent_disconnects_close_every_upstream_request(
    nursery: trio.Nursery, generator: Generator, node_address: str
) -> None:
    """Sixteen clients at once, each leaving at a random point, four rounds: every
    upstream request is closed once the edge has no run left."""
    running = await start_edge(nursery, _config(node_address))
    rng = random.Random(41)
    for _ in range(4):
        async with trio.open_nursery() as clients:
            for _ in range(16):
                clients.start_soon(_stream_then_leave, running.url, rng.randrange(0, 200))
        await running.wait_idle()
        await _upstream_idle(generator)
    await stop_edge(running)


async def test_timeouts_close_every_upstream_request(
    nursery: trio.Nursery, generator: Generator, node_address: str
) -> None:
    """A run that reaches the edge's total time ends as a timeout for its client, and
    its upstream request is closed (the node stops it as for a disconnect). The clients
    read until the edge ends the answer: on a loaded machine the total time may come
    before the first chunk."""
    running = await start_edge(nursery, _config(node_address, total_s=0.3))
    async with trio.open_nursery() as clients:
        for _ in range(8):
            clients.start_soon(_stream_then_leave, running.url, None)
    await running.wait_idle()
    await _upstream_idle(generator)
    statuses = {outcome.status for _, outcome in running.outcomes}
    assert statuses <= {"timeout", "cancelled"}, statuses
    await stop_edge(running)


async def test_drain_closes_every_upstream_request(
    nursery: trio.Nursery, generator: Generator, node_address: str
) -> None:
    """An edge that stops (its drain time past) with answers still streaming ends their
    runs, and every upstream request is closed."""
    running = await start_edge(nursery, _config(node_address, drain_timeout_s=0.2))
    async with trio.open_nursery() as clients:
        for _ in range(8):
            clients.start_soon(_stream_then_leave, running.url, None)
        await poll(lambda: generator.live == 8)
        running.edge.shutdown.set()
    await _upstream_idle(generator)
