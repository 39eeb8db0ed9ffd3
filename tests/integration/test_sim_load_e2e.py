"""The simulated node's load, over real gRPC to a node process: its queue
(`--max-runs`) as Describe reports it, and one process serving several nodes
(`--nodes`)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import trio
from grpclib.client import Channel

from edge.contract._proto.iop.node import v1 as pb
from edge.node.bridge import asyncio_loop, call_asyncio
from tests.integration.conftest import (
    STARTUP_TIMEOUT_S,
    SimProcess,
    script,
    start_sim,
    stop_process,
)

WAIT_S = 10.0
POLL_S = 0.01


def _hang(run_id: str) -> pb.RunRequest:
    content = script({"type": "delta", "delta": "x"}, {"type": "hang"})
    return pb.RunRequest(
        run_id=run_id, model="sim-script", messages=[pb.Message(role="user", content=content)]
    )


async def _until(
    stub: pb.NodeServiceStub, ready: Callable[[pb.DescribeResponse], bool]
) -> pb.DescribeResponse:
    """Describe, asked again until `ready` holds (the node is another process)."""
    async with asyncio.timeout(WAIT_S):
        while not ready(described := await stub.describe(pb.DescribeRequest())):  # noqa: ASYNC110 - another process's state
            await asyncio.sleep(POLL_S)
    return described


def _load(d: pb.DescribeResponse) -> tuple[int, int | None, int]:
    return d.active_runs, d.waiting_runs, d.max_runs


async def _queue_scenario(address: str) -> dict[str, object]:
    """Five hanging runs on a node that plays two; cancel a waiting one, then a playing one."""
    host, port = address.rsplit(":", 1)
    channel = Channel(host, int(port))
    stub = pb.NodeServiceStub(channel)
    events: dict[str, list[pb.RunEvent]] = {}
    played = {f"q{i}": asyncio.Event() for i in range(5)}  # set at a run's first event

    async def read(run_id: str) -> None:
        events[run_id] = []
        async for event in stub.run(_hang(run_id)):
            events[run_id].append(event)
            played[run_id].set()

    async def first_events(*run_ids: str) -> None:
        async with asyncio.timeout(WAIT_S):
            for run_id in run_ids:
                await played[run_id].wait()

    seen: dict[str, object] = {}
    readers: list[asyncio.Task[None]] = []
    try:
        seen["idle"] = _load(await stub.describe(pb.DescribeRequest()))
        for i in range(5):
            # One at a time, so the queue's order is the order started here.
            readers.append(asyncio.create_task(read(f"q{i}")))
            await _until(stub, lambda d, n=i + 1: d.active_runs + (d.waiting_runs or 0) == n)
        seen["five"] = _load(await stub.describe(pb.DescribeRequest()))
        await first_events("q0", "q1")
        seen["played_before_cancel"] = sorted(k for k, v in events.items() if v)
        cancel = pb.CancelRunRequest(run_id="q3", reason="test")
        seen["found"] = (await stub.cancel_run(cancel)).found
        seen["after_waiting_cancelled"] = _load(await stub.describe(pb.DescribeRequest()))
        cancel = pb.CancelRunRequest(run_id="q0", reason="test")
        await stub.cancel_run(cancel)
        seen["after_playing_cancelled"] = _load(await _until(stub, lambda d: d.waiting_runs == 1))
        await first_events("q2")
        seen["events"] = {k: [e.type for e in v] for k, v in events.items()}
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        channel.close()
    return seen


async def test_a_capped_sim_queues_runs_and_says_so(tmp_path: Path) -> None:
    """With --max-runs 2 and five runs started, Describe says 2 active and 3 waiting (and
    max_runs 2); a waiting run that is cancelled leaves the queue at once (told
    `cancelled`, logged), and a playing run that ends hands its place to the first one
    waiting: runs play in the order they came."""
    node = await trio.to_thread.run_sync(start_sim, tmp_path, "capped", "--max-runs", "2")
    try:
        async with asyncio_loop():
            with trio.fail_after(WAIT_S * 3):
                seen = await call_asyncio(_queue_scenario, node.address)
        record = await node.wait_run("q3")
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)
    assert seen["idle"] == (0, 0, 2)
    assert seen["five"] == (2, 3, 2)
    assert seen["played_before_cancel"] == ["q0", "q1"]
    assert seen["found"] is True
    assert seen["after_waiting_cancelled"] == (2, 2, 2)
    assert seen["after_playing_cancelled"] == (2, 1, 2)
    events = seen["events"]
    assert isinstance(events, dict)
    assert events["q3"] == ["cancelled"]  # never played: told, not accepted
    assert events["q2"] == ["delta"]  # took q0's place, ahead of q4
    assert events["q4"] == []
    assert (record["outcome"], record["cancel_rpcs"], record["events_sent"]) == ("cancelled", 1, 1)


@contextmanager
def _sims(tmp: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """`iop-sim-node ARGS` and the lines it printed once every node listens."""
    count = int(args[args.index("--nodes") + 1])
    command = [sys.executable, "-m", "edge.nodes.sim", "--listen", "127.0.0.1:0"]
    process = subprocess.Popen(
        [*command, "--runs-log", str(tmp / "many-runs.jsonl"), *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(count)]
        yield process, lines
    finally:
        stop_process(process)


async def _describe_and_echo(addresses: list[str]) -> list[tuple[str, str]]:
    """Each node's Describe name, and one sim-echo run on the second node."""
    names = []
    for address in addresses:
        host, port = address.rsplit(":", 1)
        channel = Channel(host, int(port))
        try:
            stub = pb.NodeServiceStub(channel)
            described = await stub.describe(pb.DescribeRequest())
            names.append((described.node_name, address))
            if address == addresses[1]:
                request = pb.RunRequest(
                    run_id="many-1",
                    model="sim-echo",
                    messages=[pb.Message(role="user", content="hello there")],
                )
                [e async for e in stub.run(request)]
        finally:
            channel.close()
    return names


async def test_one_process_serves_several_nodes(tmp_path: Path) -> None:
    """--nodes 3 serves three nodes, m-1..m-3, each on its own port, printed in order
    once all listen; a run on node 2 is logged in node 2's runs log only."""
    with _sims(tmp_path, "--nodes", "3", "--name", "m") as (process, lines):
        assert all(line.startswith("iop-sim-node m-") for line in lines), lines
        addresses = [line.rsplit(" ", 1)[1].strip() for line in lines]
        assert len(set(addresses)) == 3
        async with asyncio_loop():
            with trio.fail_after(STARTUP_TIMEOUT_S):
                names = await call_asyncio(_describe_and_echo, addresses)
        second = SimProcess(addresses[1], tmp_path / "many-runs-2.jsonl", process)
        record = await second.wait_run("many-1")
    assert [n for n, _ in names] == ["m-1", "m-2", "m-3"]
    assert [line.split()[1] for line in lines] == ["m-1", "m-2", "m-3"]
    assert record["outcome"] == "complete"
    assert not (tmp_path / "many-runs-1.jsonl").read_text()
    assert not (tmp_path / "many-runs-3.jsonl").read_text()


async def test_nodes_past_the_last_port_are_refused(tmp_path: Path) -> None:
    """--nodes K from a port whose K-th successor passes 65535 is a usage error, not a
    half-started fleet."""
    command = [sys.executable, "-m", "edge.nodes.sim", "--listen", "127.0.0.1:65535"]
    result = await trio.run_process(
        [*command, "--nodes", "2"], capture_stdout=True, capture_stderr=True, check=False
    )
    assert result.returncode == 2
    assert b"passes port 65535" in result.stderr
