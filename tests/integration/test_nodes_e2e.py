"""The node side of the contract, over real gRPC to a node process.

Called with the generated client (`NodeServiceStub`) rather than the edge's
own, so the nodes are held to the contract as any client reads it. The
iop-node case lives with its upstream fixture (test_upstream_e2e.py).
"""

from __future__ import annotations

import contextlib
import socket

import pytest
import trio
from grpclib.client import Channel

from edge.contract._proto.iop.node import v1 as pb
from edge.errors import NodeError, NodeTimeoutError, NodeUnavailableError
from edge.node.bridge import asyncio_loop, call_asyncio
from edge.node.client import GrpcNodeClient, NodeSocket, RunHandle
from edge.node.grpc import STREAMS_PER_CHANNEL
from edge.stream.events import Delta, NodeEvent
from tests.integration.conftest import SimProcess, describe_through_stub, script

WAIT_S = 10.0


async def _read_and_cancel(address: str, request: pb.RunRequest) -> tuple[list[pb.RunEvent], bool]:
    """Run `request`; after its first event, CancelRun it on another connection and read on."""
    host, port = address.rsplit(":", 1)
    reader, canceller = Channel(host, int(port)), Channel(host, int(port))
    events: list[pb.RunEvent] = []
    found = False
    try:
        async with contextlib.aclosing(pb.NodeServiceStub(reader).run(request)) as stream:
            async for event in stream:
                events.append(event)
                if len(events) == 1:
                    cancel = pb.CancelRunRequest(run_id=request.run_id, reason="test")
                    found = (await pb.NodeServiceStub(canceller).cancel_run(cancel)).found
    finally:
        reader.close()
        canceller.close()
    return events, found


async def cancel_while_reading(address: str, request: pb.RunRequest) -> list[pb.RunEvent]:
    """The events a caller still reading gets when CancelRun stops its run (found: True)."""
    async with asyncio_loop():
        with trio.fail_after(WAIT_S):
            events, found = await call_asyncio(_read_and_cancel, address, request)
    assert found
    return events


async def test_sim_tells_a_reading_caller_its_run_was_cancelled(sim: SimProcess) -> None:
    """CancelRun while the caller reads: the run's terminal is the node's `cancelled` event,
    and the runs log records one CancelRun."""
    content = script({"type": "delta", "delta": "x"}, {"type": "hang"})
    request = pb.RunRequest(
        run_id="nodes-cancel-1",
        model="sim-script",
        messages=[pb.Message(role="user", content=content)],
    )
    events = await cancel_while_reading(sim.address, request)
    assert [(e.type, e.delta, e.error) for e in events] == [
        ("delta", "x", ""),
        ("cancelled", "", "run cancelled"),
    ]
    record = await sim.wait_run(request.run_id)
    assert (record["outcome"], record["cancel_rpcs"], record["events_sent"]) == ("cancelled", 1, 2)


async def test_sim_describe_through_the_generated_stub(sim: SimProcess) -> None:
    """Describe answers through the generated base and stub: the node's name and models,
    and, without --max-runs, no cap (max_runs 0) and an empty queue."""

    response = await describe_through_stub(sim.address)
    assert [m.id for m in response.models] == ["sim-echo", "sim-script"]
    assert response.node_name
    assert (response.max_runs, response.waiting_runs) == (0, 0)


async def test_more_runs_than_one_connection_carries(sim: SimProcess) -> None:
    """Nodes advertise HTTP/2 MAX_CONCURRENT_STREAMS 100 (grpclib's, not raised): the edge
    spreads runs over connections, so 120 runs at once on one node all start and stream."""
    runs = STREAMS_PER_CHANNEL + 30
    assert runs > 100
    host, port = sim.address.rsplit(":", 1)
    content = script({"type": "delta", "delta": "x"}, {"type": "hang"})
    client = GrpcNodeClient("sim", NodeSocket.tcp(host, int(port)))
    first: list[NodeEvent] = []
    async with asyncio_loop():
        try:
            with trio.fail_after(WAIT_S * 3):
                async with trio.open_nursery() as nursery:
                    handles: list[RunHandle] = []
                    for i in range(runs):
                        request = pb.RunRequest(
                            run_id=f"many-{i}",
                            model="sim-script",
                            messages=[pb.Message(role="user", content=content)],
                        )
                        deadline = trio.current_time() + WAIT_S * 3
                        handles.append(await client.start_run(nursery, request, deadline=deadline))
                    for handle in handles:
                        first.append(await handle.events.receive())
                    nursery.cancel_scope.cancel()  # every run still hangs: end them all
        finally:
            await client.aclose()
    assert first == [Delta("x")] * runs


async def test_a_run_is_accepted_by_a_named_life_of_the_node(sim: SimProcess) -> None:
    """The node names the life of its process in each Run's accept (its initial metadata),
    the same instance id its Describe gives: the edge's handle of the run holds it."""
    host, port = sim.address.rsplit(":", 1)
    client = GrpcNodeClient("sim", NodeSocket.tcp(host, int(port)))
    request = pb.RunRequest(
        run_id="instance-1", model="sim-echo", messages=[pb.Message(role="user", content="hi")]
    )
    async with asyncio_loop():
        try:
            with trio.fail_after(WAIT_S):
                described = await client.describe()
                async with trio.open_nursery() as nursery:
                    deadline = trio.current_time() + WAIT_S
                    handle = await client.start_run(nursery, request, deadline=deadline)
        finally:
            await client.aclose()
    assert len(described.instance) == 16
    assert handle.instance == described.instance


@pytest.mark.parametrize("listening", [False, True])
async def test_a_run_that_failed_to_start_says_whether_it_was_sent(listening: bool) -> None:
    """The accept clock: a port that refuses the connection fails the run at once, with
    the RunRequest never written (`sent` False: no process saw it, so another attempt
    of the request may go there once it is up); a listener that takes the connection and
    never answers has it written, then does not accept it in `accept_s` (`sent` True)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if listening:
            listener.listen(1)
        else:
            listener.close()
        client = GrpcNodeClient("x", NodeSocket.tcp("127.0.0.1", port))
        request = pb.RunRequest(
            run_id="sent-1", model="m", messages=[pb.Message(role="user", content="hi")]
        )
        async with asyncio_loop():
            try:
                with trio.fail_after(WAIT_S):
                    async with trio.open_nursery() as nursery:
                        deadline = trio.current_time() + WAIT_S
                        with pytest.raises(NodeError) as raised:
                            await client.start_run(
                                nursery, request, deadline=deadline, accept_s=0.2
                            )
            finally:
                await client.aclose()
    if listening:
        assert isinstance(raised.value, NodeTimeoutError)
        assert "did not accept the run" in raised.value.message
        assert raised.value.sent
    else:
        assert isinstance(raised.value, NodeUnavailableError)
        assert not raised.value.sent
