"""A run whose client left is cancelled on its node once, unless its node had ended it.

Over real gRPC to a real node process, through the node client: a run still
generating when its client leaves (its request cut, or the handle told) gets
exactly one CancelRun, and its read task is over when its request's nursery is;
a run whose node has ended it (its runs-log line written: the terminal sent)
when its client leaves gets none, whether the edge had read the terminal or it
was still on its way (`edge.node.grpc.settle_read`). CancelRuns are counted
where the edge sends them (`on_cancel_sent`) and where the node receives them.
"""

from __future__ import annotations

import math
import time
from typing import Any

import trio

from edge.contract._proto.iop.node import v1 as pb
from edge.node.bridge import asyncio_loop
from edge.node.client import EndCause, GrpcNodeClient, NodeSocket
from tests.integration.conftest import SimProcess, script

WAIT_S = 30.0
HANG = {"type": "hang"}


def _request(run_id: str, *events: dict[str, Any]) -> pb.RunRequest:
    return pb.RunRequest(
        run_id=run_id,
        model="sim-script",
        messages=[pb.Message(role="user", content=script(*events))],
    )


def _block_until_ended(node: SimProcess, run_id: str) -> dict[str, Any]:
    """Block this thread, the edge's loop with it, until the node logged the run's end:
    its terminal was sent, and the edge (busy, as a loaded edge is) has not read it."""
    deadline = time.monotonic() + WAIT_S
    while (run := node.run(run_id)) is None:
        assert time.monotonic() < deadline, f"the node did not end {run_id}"
        time.sleep(0.002)  # blocking on purpose: the loop must not run meanwhile
    return run


def _cancel_lines(sim: SimProcess, run_id: str) -> int:
    """CancelRuns the node logged for an id it did not know (a run already over)."""
    return sum(1 for r in sim.runs() if r.get("type") == "cancel_rpc" and r.get("run_id") == run_id)


async def test_a_generating_run_whose_request_is_cut_gets_one_cancel(node: SimProcess) -> None:
    """A run still generating whose request is cut from outside (the client left) is
    cancelled on its node exactly once; its read task ends within the nursery."""
    host, port = node.address.rsplit(":", 1)
    sent: list[str] = []
    client = GrpcNodeClient(
        "sim", NodeSocket.tcp(host, int(port)), on_cancel_sent=lambda: sent.append("x")
    )
    async with asyncio_loop():
        try:
            with trio.fail_after(WAIT_S):
                async with trio.open_nursery() as nursery:
                    request = _request("settle-cut", {"type": "delta", "delta": "a"}, HANG)
                    handle = await client.start_run(nursery, request, deadline=math.inf)
                    nursery.cancel_scope.cancel()
                assert handle.done.is_set()
                assert handle.cause is EndCause.CLIENT_GONE
                assert not handle.finished
                run = await node.wait_run("settle-cut")
        finally:
            await client.aclose()
    assert sent == ["x"]
    assert (run["outcome"], run["cancel_rpcs"]) == ("cancelled", 1)


async def test_a_generating_run_whose_client_left_gets_one_cancel(node: SimProcess) -> None:
    """Told the client left (CLIENT_GONE), a run still generating is cancelled on its node
    exactly once, after its settling passes."""
    host, port = node.address.rsplit(":", 1)
    sent: list[str] = []
    client = GrpcNodeClient(
        "sim", NodeSocket.tcp(host, int(port)), on_cancel_sent=lambda: sent.append("x")
    )
    async with asyncio_loop():
        try:
            with trio.fail_after(WAIT_S):
                async with trio.open_nursery() as nursery:
                    handle = await client.start_run(
                        nursery, _request("settle-gone", HANG), deadline=math.inf
                    )
                    handle.cancel(EndCause.CLIENT_GONE)
                    await handle.done.wait()
                run = await node.wait_run("settle-gone")
        finally:
            await client.aclose()
    assert sent == ["x"]
    assert (run["outcome"], run["cancel_rpcs"]) == ("cancelled", 1)


async def test_a_run_its_node_ended_gets_no_cancel_when_its_client_leaves(
    node: SimProcess,
) -> None:
    """A run its node has ended (the runs-log line is written once the terminal is sent)
    and whose client then leaves, before the edge read the terminal (its loop busy), gets
    no CancelRun: the edge takes what the node sent before it decides."""
    host, port = node.address.rsplit(":", 1)
    sent: list[str] = []
    client = GrpcNodeClient(
        "sim", NodeSocket.tcp(host, int(port)), on_cancel_sent=lambda: sent.append("x")
    )
    async with asyncio_loop():
        try:
            with trio.fail_after(WAIT_S):
                for n in range(20):
                    run_id = f"settle-ended-{n}"
                    async with trio.open_nursery() as nursery:
                        request = _request(
                            run_id, {"type": "delta", "delta": "a"}, {"sleep_ms": 20},
                            {"type": "complete"},
                        )  # fmt: skip
                        handle = await client.start_run(nursery, request, deadline=math.inf)
                        # The terminal comes 20 ms after the accept: in the connection,
                        # unread, when the client leaves (or, on a slow machine, read).
                        run = _block_until_ended(node, run_id)
                        handle.cancel(EndCause.CLIENT_GONE)
                    assert handle.finished
                    assert (run["outcome"], run["cancel_rpcs"]) == ("complete", 0)
                    assert _cancel_lines(node, run_id) == 0
        finally:
            await client.aclose()
    assert sent == []
