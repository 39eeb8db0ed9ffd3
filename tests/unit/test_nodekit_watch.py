"""Watch as every node serves it (`edge.nodes.kit`): reports at once, on a change and at
the heartbeat; changes coalesced; watchers bounded, released, and never buffered for.

A real node (the simulated one, or a subclass that counts its `describe`s) on a
real socket, read with grpclib's own client on asyncio, as a node runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.routes import RUN_ROUTE, WATCH_ROUTE
from edge.nodes.kit import (
    WATCH_HEARTBEAT_MAX_MS,
    WATCH_HEARTBEAT_MIN_MS,
    WATCH_HEARTBEAT_MS,
    start_server,
    stop_server,
    watch_heartbeat_ms,
)
from edge.nodes.sim.server import SimNode

WAIT_S = 10.0
HANG = '{"events": [{"type": "hang"}]}'


class CountingNode(SimNode):
    """The simulated node, counting its `describe`s (each report is one)."""

    def __init__(self, *, models: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.describes = 0
        self.extra_models = models

    async def describe(self, message: pb.DescribeRequest) -> pb.DescribeResponse:
        self.describes += 1
        answer = await super().describe(message)
        for i in range(self.extra_models):
            answer.models.append(pb.ModelInfo(id=f"m{i:04d}-" + "x" * 1000))
        return answer


async def _until(condition: Callable[[], bool]) -> None:
    """Wait for another party's state (a server handler's), bounded."""
    async with asyncio.timeout(WAIT_S):
        while not condition():  # noqa: ASYNC110 - a server handler's state: no event
            await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def _serving(node: SimNode) -> AsyncIterator[int]:
    server, port = await start_server(node, "127.0.0.1", 0)
    try:
        yield port
    finally:
        await stop_server(node, server)


@contextlib.asynccontextmanager
async def _watching(
    port: int, heartbeat_ms: int = 0, config: Configuration | None = None
) -> AsyncIterator[Any]:
    """A Watch stream on a connection of its own, closed on the way out (the watcher
    leaves: the stream's own exit then waits for nothing)."""
    channel = Channel("127.0.0.1", port, config=config)
    try:
        stream = channel.request(
            WATCH_ROUTE, Cardinality.UNARY_STREAM, pb.WatchRequest, pb.DescribeResponse
        )
        async with stream:
            await stream.send_message(pb.WatchRequest(heartbeat_ms=heartbeat_ms), end=True)
            try:
                yield stream
            finally:
                channel.close()
    finally:
        channel.close()


async def _report(stream: Any) -> pb.DescribeResponse:
    async with asyncio.timeout(WAIT_S):
        report = await stream.recv_message()
    assert report is not None
    return report  # type: ignore[no-any-return]


def _run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())  # type: ignore[arg-type]


def test_the_heartbeat_asked_is_clamped_to_the_nodes_range() -> None:
    """0 is the node's default; anything else is held to the node's range."""
    assert watch_heartbeat_ms(0) == WATCH_HEARTBEAT_MS
    assert watch_heartbeat_ms(1) == WATCH_HEARTBEAT_MIN_MS
    assert watch_heartbeat_ms(1500) == 1500
    assert watch_heartbeat_ms(2**32 - 1) == WATCH_HEARTBEAT_MAX_MS


def test_a_report_at_once_on_a_run_start_and_end_and_at_the_heartbeat() -> None:
    """The first report comes at once (seq 1, the heartbeat granted); a run that starts
    and one that ends are each reported (active_runs 1, then 0); with no change, reports
    still come, each numbered one more than the last, each from one `describe`."""

    async def main() -> None:
        node = CountingNode()
        async with _serving(node) as port, _watching(port, WATCH_HEARTBEAT_MIN_MS) as stream:
            first = await _report(stream)
            assert (first.seq, first.heartbeat_ms, first.active_runs) == (1, 100, 0)
            assert [m.id for m in first.models] == ["sim-echo", "sim-script"]
            runner = Channel("127.0.0.1", port)
            try:
                route = (RUN_ROUTE, Cardinality.UNARY_STREAM, pb.RunRequest, pb.RunEvent)
                run = runner.request(*route)
                async with run:
                    request = pb.RunRequest(
                        run_id="w1", model="sim-script",
                        messages=[pb.Message(role="user", content=HANG)],
                    )  # fmt: skip
                    await run.send_message(request, end=True)
                    seqs = [first.seq]
                    while (report := await _report(stream)).active_runs != 1:
                        seqs.append(report.seq)
                    seqs.append(report.seq)
                    await run.cancel()
            finally:
                runner.close()
            while (report := await _report(stream)).active_runs != 0:
                seqs.append(report.seq)
            seqs.append(report.seq)
            for _ in range(3):  # no change now: the heartbeat's reports
                seqs.append((await _report(stream)).seq)
            assert seqs == list(range(1, len(seqs) + 1))
            assert node.describes == len(seqs)

    _run(main)


def test_many_changes_between_two_reports_are_one_report() -> None:
    """A thousand changes in one step, heartbeat far away: one report follows (seq 2), made
    by one `describe`; no second one is pending."""

    async def main() -> None:
        node = CountingNode()
        async with _serving(node) as port, _watching(port, WATCH_HEARTBEAT_MAX_MS) as stream:
            assert (await _report(stream)).seq == 1
            for _ in range(1000):
                node.state_changed()
            assert (await _report(stream)).seq == 2
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):  # five minimum intervals: nothing more
                    await stream.recv_message()
            assert node.describes == 2

    _run(main)


def test_watchers_past_the_cap_are_refused_and_one_that_leaves_is_released() -> None:
    """With room for two watchers, a third is answered RESOURCE_EXHAUSTED; once one of the
    two leaves (its connection closed) its place is free again; stopping the node releases
    the rest."""

    class TwoWatchers(CountingNode):
        max_watchers = 2

    async def main() -> None:
        node = TwoWatchers()
        server, port = await start_server(node, "127.0.0.1", 0)
        try:
            async with _watching(port) as one:
                await _report(one)
                async with _watching(port) as two:
                    await _report(two)
                    assert node.watchers == 2
                    async with _watching(port) as three:
                        with pytest.raises(GRPCError) as refused:
                            await _report(three)
                        assert refused.value.status is Status.RESOURCE_EXHAUSTED
                await _until(lambda: node.watchers == 1)
                async with _watching(port) as four:
                    assert (await _report(four)).seq == 1
                    assert node.watchers == 2
                    await stop_server(node, server)
                    assert node.watchers == 0
        finally:
            server.close()

    _run(main)


def test_a_watcher_that_does_not_read_is_dropped_not_buffered_for() -> None:
    """Reports larger than the watcher's flow-control window, a watcher that reads none,
    and changes coming all the while: the node makes one report and waits on it (no
    queue), then drops the watcher after `watch_send_s`."""

    class Impatient(CountingNode):
        watch_send_s = 0.3

    async def main() -> None:
        node = Impatient(models=200)  # a report of about 200 KB
        small_window = Configuration(
            http2_connection_window_size=65535, http2_stream_window_size=65535
        )
        async with _serving(node) as port, _watching(port, 100, small_window):
            await _until(lambda: node.watchers == 1)
            for _ in range(50):
                node.state_changed()
                await asyncio.sleep(0.01)
            await _until(lambda: node.watchers == 0)
            assert node.describes == 1

    _run(main)


def test_a_node_without_watch_answers_as_an_older_node() -> None:
    """The simulated node with `watch=False` (`--no-watch`) answers Watch as a node older
    than the RPC: grpclib's answer to a method it does not have, a trailers-only
    UNIMPLEMENTED without a content-type, which grpclib's client reads as UNKNOWN (the
    edge takes both for "no Watch": edge.node.grpc.NodeWatch)."""

    async def main() -> None:
        async with _serving(SimNode(watch=False)) as port, _watching(port) as stream:
            with pytest.raises(GRPCError) as refused:
                await _report(stream)
            assert refused.value.status in (Status.UNIMPLEMENTED, Status.UNKNOWN)

    _run(main)


def test_a_node_that_stops_tells_its_watchers() -> None:
    """The node stops while watched: the watcher is told at once (UNAVAILABLE, "the node is
    stopping"), not left to find out from its silence bound; no watcher is left."""

    async def main() -> None:
        node = CountingNode()
        server, port = await start_server(node, "127.0.0.1", 0)
        try:
            async with _watching(port) as stream:
                await _report(stream)
                await stop_server(node, server)
                async with asyncio.timeout(WAIT_S):
                    assert await stream.recv_message() is None  # the end: the status follows
                    with pytest.raises(GRPCError) as told:
                        await stream.recv_trailing_metadata()
                assert told.value.status is Status.UNAVAILABLE
                assert told.value.message == "the node is stopping"
                assert node.watchers == 0
        finally:
            server.close()

    _run(main)
