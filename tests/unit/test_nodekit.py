"""What every node keeps in memory (`edge.nodes.kit`): its runs log, a refused message;
the run bookkeeping every node shares (`NodeService.serve_run`); and its stop.

A node serves for months: in memory it keeps the runs in flight and a window of
the last records, never one record per run it ever served; the file gets them all.
A request over the gRPC limit it refuses is not kept either (a real node on a
real socket, on asyncio as a node runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.routes import RUN_ROUTE
from edge.nodes.kit import STOP_WAIT_S, NodeService, start_server, stop_server
from edge.nodes.runslog import FINISHED_KEPT, RunsLog
from edge.nodes.sim.server import SimNode
from edge.nodes.upstream.server import UpstreamNode

MiB = 1024 * 1024


def test_runs_log_keeps_a_bounded_window_of_records(tmp_path: Path) -> None:
    """After more runs than the window, the records kept in memory stay at FINISHED_KEPT
    (the latest ones, in order), nothing else per run is left, and the file has every line."""
    path = tmp_path / "runs.jsonl"
    log = RunsLog(path)
    total = FINISHED_KEPT * 2 + 17
    for i in range(total):
        run = log.start(f"run{i}", "sim-echo")
        run.outcome = "complete"
        log.ended(run)
        assert len(log.finished) == min(i + 1, FINISHED_KEPT)
    log.close()
    assert [r["run_id"] for r in log.finished] == [
        f"run{i}" for i in range(total - FINISHED_KEPT, total)
    ]
    assert log.active == 0
    assert not log._runs
    lines = path.read_text().splitlines()
    assert len(lines) == total
    assert json.loads(lines[-1])["run_id"] == f"run{total - 1}"


def test_unknown_cancel_rpcs_are_bounded_too() -> None:
    """CancelRuns for ids the node does not know (one record each) fill the same window."""
    log = RunsLog()
    for i in range(FINISHED_KEPT + 50):
        assert log.cancel_rpc(f"nope{i}") == (None, False)
    assert len(log.finished) == FINISHED_KEPT
    last = log.finished[-1]
    assert (last["type"], last["run_id"], last["found"]) == (
        "cancel_rpc", f"nope{FINISHED_KEPT + 49}", False,
    )  # fmt: skip
    assert isinstance(last["at"], float)  # when: the chaos witness places it in a life


def test_a_run_id_served_again_keeps_both_lines() -> None:
    """A run that ended aborted (its line waits out the CancelRun grace), then the same
    run id again (an answer moved back to this node): the first line is written at once,
    the second run's CancelRun is its own, and each run has its line."""
    asyncio.run(_served_again())


async def _served_again() -> None:
    log = RunsLog()
    first = log.start("r1", "sim-script")
    first.outcome = "aborted"
    log.ended(first)  # waits for a CancelRun
    second = log.start("r1", "sim-script")
    assert [r["outcome"] for r in log.finished] == ["aborted"]
    live, found = log.cancel_rpc("r1")
    assert (live, found) == (second, True)
    second.outcome = "cancelled"
    log.ended(second)
    assert [(r["outcome"], r["cancel_rpcs"]) for r in log.finished] == [
        ("aborted", 0), ("cancelled", 1),
    ]  # fmt: skip
    assert log.active == 0
    assert not log._runs


def test_a_refused_oversized_request_is_not_kept() -> None:
    """A node refuses a RunRequest over the gRPC limit (RESOURCE_EXHAUSTED) and keeps
    nothing of it: with the garbage collector off, four refusals leave less than one
    message traced (the refusal is raised and handled by grpclib's server, and no error
    holding its frames is stored)."""
    request = pb.RunRequest(
        run_id="big", model="sim-echo", messages=[pb.Message(role="user", content="y" * 5 * MiB)]
    )

    async def refused(channel: Channel) -> Status | None:
        try:
            async with channel.request(
                RUN_ROUTE, Cardinality.UNARY_STREAM, pb.RunRequest, pb.RunEvent
            ) as stream:
                await stream.send_message(request, end=True)
                async for _ in stream:
                    pass
        except GRPCError as exc:
            return exc.status
        return None

    async def main() -> int:
        node = SimNode()
        server, port = await start_server(node, "127.0.0.1", 0)
        channel = Channel("127.0.0.1", port)
        try:
            assert await refused(channel) is Status.RESOURCE_EXHAUSTED  # warm up
            gc.collect()
            gc.disable()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(4):
                assert await refused(channel) is Status.RESOURCE_EXHAUSTED
            return tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
            gc.enable()
            channel.close()
            await stop_server(node, server)

    assert asyncio.run(main()) < 5 * MiB


def test_a_node_stops_while_a_client_keeps_its_connection() -> None:
    """A client that called the node and keeps its connection open, as an edge keeps its
    connections to a node, does not hold the node's stop: `stop_server` returns (from
    CPython 3.12.1 grpclib alone would wait for the client to hang up)."""

    async def main() -> None:
        node = SimNode()
        server, port = await start_server(node, "127.0.0.1", 0)
        channel = Channel("127.0.0.1", port)
        try:
            await pb.NodeServiceStub(channel).describe(pb.DescribeRequest())
            async with asyncio.timeout(STOP_WAIT_S * 10):
                await stop_server(node, server)
        finally:
            channel.close()

    asyncio.run(main())


class _AcceptingStream:
    """A Run stream whose acceptance (the response headers) waits until the test's end."""

    def __init__(self, request: pb.RunRequest) -> None:
        self.metadata: dict[str, str] = {}
        self.request = request
        self.accepting = asyncio.Event()
        self.sent: list[Any] = []

    async def recv_message(self) -> pb.RunRequest:
        return self.request

    async def send_initial_metadata(self, *, metadata: dict[str, str] | None = None) -> None:
        self.accepting.set()
        await asyncio.Event().wait()

    async def send_message(self, message: Any) -> None:
        self.sent.append(message)


@pytest.mark.parametrize("kind", ["sim", "upstream"])
def test_a_cancel_run_while_the_run_is_accepted_finds_it(kind: str) -> None:
    """Every node records a run before it accepts it: a CancelRun that arrives while the
    run is being accepted finds it (found: True), stops it, and the caller is told."""
    request = pb.RunRequest(
        run_id="r1", model="sim-echo", messages=[pb.Message(role="user", content="hi")]
    )

    async def main() -> tuple[bool, list[Any], dict[str, Any]]:
        node: NodeService = (
            SimNode() if kind == "sim" else UpstreamNode("http://127.0.0.1:9/v1", models=("m",))
        )
        stream = _AcceptingStream(request)
        serving = asyncio.create_task(node.serve_run(stream))  # type: ignore[arg-type]
        await stream.accepting.wait()
        answer = await node.cancel_run(pb.CancelRunRequest(run_id="r1", reason="test"))
        if not answer.found:  # the run plays on: stop it here, the assertions say why
            serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await node.aclose()
        return answer.found, stream.sent, node.finished[-1]

    found, sent, record = asyncio.run(main())
    assert found
    assert [(e.type, e.error) for e in sent] == [("cancelled", "run cancelled")]
    assert (record["outcome"], record["cancel_rpcs"], record["events_sent"]) == ("cancelled", 1, 1)
