"""Watch over real sockets and real node processes: the edge's client of the stream, the
pool that keeps each node from it, and routing by the load a node reports.

- The client (`GrpcNodeClient.watch`), against a node served on the test's own
  asyncio loop (so the node's watchers can be counted): checked reports, an
  older node told apart, a broken stream ending the iterator with an error,
  and nothing left of a subscription once its iterator is left.
- Two edge processes in front of two nodes, one busy with another tenant's
  long runs: the new runs go to the idle node, because both edges read the
  busy node's own count, not their share of it.
- A node killed and restarted on its port, one stopped (SIGSTOP) past its
  silence bound and continued, one older than Watch (`--no-watch`, polled
  with Describe), and that node upgraded in place: the edge marks each down
  or up as it should, and asks Describe only of the node that has no Watch.

Waits are bounded polls on the edge's state or metrics, or the nodes' runs
logs; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.config import Config, NodeConfig, RoutingConfig, ServerConfig
from edge.contract._proto.iop.node import v1 as pb
from edge.errors import EdgeError
from edge.fleet.nodestate import NodeState
from edge.node.bridge import asyncio_loop, call_asyncio
from edge.node.client import GrpcNodeClient, NodeSocket, RunHandle, WatchUnsupported
from edge.nodes.kit import start_server, stop_server
from edge.nodes.sim.server import SimNode
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    named_sims,
    poll,
    script,
    start_edge,
    start_sim,
    stop_edge,
    stop_process,
)
from tests.integration.edgeproc import edge_process, free_port, kill, start_sim_on
from tests.integration.test_ops_e2e import Metrics, scrape

CHAT = "/v1/chat/completions"
WAIT_S = 20.0


# --- the client ---------------------------------------------------------------------------


@asynccontextmanager
async def _served(node: SimNode) -> AsyncIterator[GrpcNodeClient]:
    """`node` served on a real socket from the test's asyncio loop, and a client of it."""
    async with asyncio_loop():
        server, port = await call_asyncio(start_server, node, "127.0.0.1", 0)
        client = GrpcNodeClient(node.name, NodeSocket.tcp("127.0.0.1", port))
        try:
            yield client
        finally:
            await client.aclose()
            with trio.CancelScope(shield=True):
                await call_asyncio(stop_server, node, server)


async def _asyncio_tasks() -> int:
    return len(asyncio.all_tasks())


async def test_watch_gives_checked_reports_and_leaving_it_leaves_nothing() -> None:
    """The first report is the node's state (its models, seq 1, the heartbeat it keeps);
    a run that starts is reported. Once the iterator is left, the node has no watcher and
    the asyncio loop runs no more tasks than before the subscription."""
    node = SimNode(name="w")
    async with _served(node) as client:
        before = await call_asyncio(_asyncio_tasks)
        reports = client.watch(0.1)
        async with contextlib.aclosing(reports):
            with trio.fail_after(WAIT_S):
                first = await anext(reports)
                assert (first.name, first.models, first.seq) == ("w", ("sim-echo", "sim-script"), 1)
                assert (first.heartbeat_ms, first.active_runs) == (100, 0)
                assert node.watchers == 1
                async with trio.open_nursery() as nursery:
                    request = pb.RunRequest(
                        run_id="watched", model="sim-script",
                        messages=[pb.Message(role="user", content=script({"type": "hang"}))],
                    )  # fmt: skip
                    handle = await client.start_run(
                        nursery, request, deadline=trio.current_time() + WAIT_S
                    )
                    while (await anext(reports)).active_runs != 1:
                        pass
                    handle.cancel("client_disconnected")
        await poll(lambda: node.watchers == 0)
        await _poll_async(lambda: call_asyncio(_asyncio_tasks), before)


async def _poll_async(value: Callable[[], Any], wanted: int) -> None:
    with trio.fail_after(WAIT_S):
        while await value() > wanted:  # noqa: ASYNC110 - another loop's state: no event
            await trio.sleep(0.01)


async def test_a_node_older_than_watch_is_told_apart() -> None:
    """A node without the Watch route: the iterator raises WatchUnsupported (the pool's cue
    to poll Describe), not an error that would mark the node down."""
    async with _served(SimNode(watch=False)) as client:
        reports = client.watch(1.0)
        async with contextlib.aclosing(reports):
            with pytest.raises(WatchUnsupported), trio.fail_after(WAIT_S):
                await anext(reports)


async def test_a_stream_that_breaks_ends_the_iterator_with_an_error() -> None:
    """The node stops while watched: the next step of the iterator raises the edge's
    error (the stream broke), it does not hang or end quietly."""
    node = SimNode(name="w")
    async with asyncio_loop():
        server, port = await call_asyncio(start_server, node, "127.0.0.1", 0)
        client = GrpcNodeClient("w", NodeSocket.tcp("127.0.0.1", port))
        try:
            reports = client.watch(0.1)
            async with contextlib.aclosing(reports):
                with trio.fail_after(WAIT_S):
                    await anext(reports)
                    await call_asyncio(stop_server, node, server)
                    with pytest.raises(EdgeError):
                        await _drain(reports)
        finally:
            await client.aclose()


async def _drain(reports: AsyncIterator[Any]) -> None:
    """Take reports until the iterator raises (or ends)."""
    async for _ in reports:
        pass


# --- routing by the node's own load, two edge processes ------------------------------------

BUSY = 20  # another tenant's runs on node n1
REQUESTS = 8  # per edge: 16 in all, fewer than BUSY


def _edge_toml(n1: SimProcess, n2: SimProcess) -> str:
    return (
        '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'
        "[routing]\nwatch_heartbeat_s = 0.5\n"
        f'[[nodes]]\nname = "n1"\naddress = "{n1.address}"\n'
        f'[[nodes]]\nname = "n2"\naddress = "{n2.address}"\n'
    )


async def _busy(client: GrpcNodeClient, nursery: trio.Nursery, count: int) -> list[RunHandle]:
    """`count` runs that hang on the node, started on it directly (another tenant's)."""
    content = script({"type": "delta", "delta": "x"}, {"type": "hang"})
    handles = []
    for i in range(count):
        request = pb.RunRequest(
            run_id=f"busy-{i}", model="sim-script",
            messages=[pb.Message(role="user", content=content)],
        )  # fmt: skip
        deadline = trio.current_time() + 120
        handles.append(await client.start_run(nursery, request, deadline=deadline))
    return handles


async def test_two_edges_send_new_runs_to_the_node_that_reports_less_load(tmp_path: Path) -> None:
    """Node n1 (listed first) runs 20 long runs of another tenant, n2 none. Two edge
    processes each send 8 short requests at once: every one of the 16 runs on n2. By
    construction: both edges read n1's own count (20, from its Watch reports) before the
    requests; n2's count as an edge sees it (its last report, plus the edge's runs
    started since) never passes the 16 runs there are, so n2 ranks first for each one.
    An edge counting only its own runs on each node would have sent some to n1."""
    with named_sims(tmp_path, "n1", "n2") as (n1, n2):
        await _two_edges_ask(tmp_path, n1, n2, _busy, BUSY, "iop_edge_node_active_runs", BUSY)


async def _two_edges_ask(
    tmp_path: Path,
    n1: SimProcess,
    n2: SimProcess,
    busy: Callable[[GrpcNodeClient, trio.Nursery, int], Awaitable[list[RunHandle]]],
    count: int,
    gauge: str,
    wanted: float,
) -> None:
    """Another tenant's `count` runs on n1 (`busy`); once both edge processes show n1's
    `gauge` at `wanted` (its report), each sends REQUESTS short requests at once: every
    one is answered, and every one ran on n2."""
    host, port = n1.address.rsplit(":", 1)
    tenant = GrpcNodeClient("n1", NodeSocket.tcp(host, int(port)))
    answers: list[httpx.Response] = []
    async with asyncio_loop():
        try:
            async with trio.open_nursery() as runs:
                await busy(tenant, runs, count)
                async with (
                    edge_process(tmp_path, _edge_toml(n1, n2), name="edge1") as edge1,
                    edge_process(tmp_path, _edge_toml(n1, n2), name="edge2") as edge2,
                    httpx.AsyncClient(base_url=edge1.url, timeout=WAIT_S) as http1,
                    httpx.AsyncClient(base_url=edge2.url, timeout=WAIT_S) as http2,
                ):
                    for http in (http1, http2):
                        await _poll_metrics(http, gauge, wanted, node="n1")

                    async def ask(http: httpx.AsyncClient, i: int) -> None:
                        body = chat_body("sim-echo", f"q{i}")
                        answers.append(await http.post(CHAT, json=body))

                    async with trio.open_nursery() as asks:
                        for i in range(REQUESTS):
                            asks.start_soon(ask, http1, i)
                            asks.start_soon(ask, http2, REQUESTS + i)
                runs.cancel_scope.cancel()  # the tenant's runs: each cancelled on n1
        finally:
            await tenant.aclose()
    assert [a.status_code for a in answers] == [200] * (2 * REQUESTS)
    ran_on_n1 = [r for r in n1.runs() if not str(r.get("run_id", "")).startswith("busy-")]
    ran_on_n2 = [r for r in n2.runs() if "outcome" in r]
    assert ran_on_n1 == []
    assert len(ran_on_n2) == 2 * REQUESTS


async def _poll_metrics(
    http: httpx.AsyncClient, name: str, wanted: float, **labels: str
) -> Metrics:
    """Scrape until `name{labels}` is `wanted` (another process's view: no event)."""
    with trio.fail_after(WAIT_S):
        while (metrics := await scrape(http)).value(name, **labels) != wanted:  # noqa: ASYNC110
            await trio.sleep(0.02)
    return metrics


# --- the pool, one node process at a time ---------------------------------------------------


def _config(address: str, **routing: Any) -> Config:
    return Config(
        # Describe polling far away: any Describe after the first look is the fallback's.
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0, node_refresh_s=600),
        routing=RoutingConfig(**routing),
        nodes=(NodeConfig("sim", address),),
    )


def _rpcs(running: RunningEdge, rpc: str) -> float:
    value = running.edge.metrics.registry.get_sample_value(
        "iop_edge_node_state_rpcs_total", {"node": "sim", "rpc": rpc}
    )
    return value or 0.0


def _node(running: RunningEdge) -> NodeState:
    return running.edge.pool.nodes[0]


async def _answers(running: RunningEdge) -> None:
    async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as http:
        answer = await http.post(CHAT, json=chat_body("sim-echo", "hello"))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "hello"


async def test_a_node_killed_and_restarted_is_watched_again_without_describe(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The watched node is killed: its stream breaks, the re-subscriptions fail, it is down.
    Restarted on its port, the next subscription brings it up with its load, and it serves
    again; after the first look at startup, the edge never asked it Describe."""
    port = free_port()
    runs_log = tmp_path / "runs.jsonl"
    process = await trio.to_thread.run_sync(start_sim_on, port, runs_log)
    try:
        running = await start_edge(nursery, _config(f"127.0.0.1:{port}"))
        pool, state = running.edge.pool, _node(running)
        await poll(lambda: state.load is not None)
        assert (_rpcs(running, "describe"), _rpcs(running, "watch")) == (1, 1)

        kill(process)
        await poll(lambda: pool.state_of(state) == "down")
        assert state.load is None
        process = await trio.to_thread.run_sync(start_sim_on, port, runs_log)
        await poll(lambda: pool.state_of(state) == "up" and state.load is not None)
        await _answers(running)
        assert _rpcs(running, "describe") == 1
        assert _rpcs(running, "watch") >= 3  # the first, at least one that failed, the last
        await stop_edge(running)
    finally:
        kill(process)


async def test_a_node_silent_past_its_bound_is_down_until_it_reports_again(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The node is stopped (SIGSTOP): no report comes, the connection stays open. Past the
    silence bound (3 heartbeats of 0.2 s, at least 1 s) it is suspect, then down, its load
    forgotten. Continued (SIGCONT), it reports again on a new subscription, is up, and
    serves."""
    sim = start_sim(tmp_path)
    try:
        running = await start_edge(nursery, _config(sim.address, watch_heartbeat_s=0.2))
        pool, state = running.edge.pool, _node(running)
        await poll(lambda: state.load is not None)
        sim.process.send_signal(signal.SIGSTOP)
        try:
            await poll(lambda: pool.state_of(state) == "down")
            assert state.load is None
        finally:
            sim.process.send_signal(signal.SIGCONT)
        await poll(lambda: pool.state_of(state) == "up" and state.load is not None)
        await _answers(running)
        assert _rpcs(running, "describe") == 1
        await stop_edge(running)
    finally:
        sim.process.send_signal(signal.SIGCONT)
        stop_process(sim.process)


async def test_a_node_older_than_watch_is_polled_and_watched_once_upgraded(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A node that answers Watch as an older node (`--no-watch`) is served, its state
    from Describe every node_refresh_s (iop_edge_node_watched 0, no load). Replaced on its
    port by a node with Watch (down, then up), the edge tries Watch again and keeps it."""
    port = free_port()
    runs_log = tmp_path / "runs.jsonl"
    process = await trio.to_thread.run_sync(start_sim_on, port, runs_log, "--no-watch")
    try:
        config = _config(f"127.0.0.1:{port}")
        config = replace(config, server=replace(config.server, node_refresh_s=0.2))
        running = await start_edge(nursery, config)
        pool, state = running.edge.pool, _node(running)
        await poll(lambda: state.polled)
        await poll(lambda: _rpcs(running, "describe") >= 4)  # polled, every 0.2 s
        assert _rpcs(running, "watch") == 1
        assert state.load is None
        await _answers(running)
        async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as http:
            assert (await scrape(http)).value("iop_edge_node_watched", node="sim") == 0

        kill(process)
        await poll(lambda: pool.state_of(state) == "down")
        process = await trio.to_thread.run_sync(start_sim_on, port, runs_log)
        await poll(lambda: state.load is not None)
        assert not state.polled
        assert pool.state_of(state) == "up"
        async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as http:
            assert (await scrape(http)).value("iop_edge_node_watched", node="sim") == 1
        await _answers(running)
        await stop_edge(running)
    finally:
        kill(process)


QUEUED = 12  # another tenant's runs on n1: 2 playing, 10 in its queue


async def _busy_queued(
    client: GrpcNodeClient, nursery: trio.Nursery, count: int
) -> list[RunHandle]:
    """`count` runs that hang on the node, started on it directly (another tenant's), each
    in a task of its own: those past the node's places wait unaccepted in its queue."""
    handles: list[RunHandle] = []
    content = script({"type": "delta", "delta": "x"}, {"type": "hang"})

    async def start(i: int) -> None:
        request = pb.RunRequest(
            run_id=f"busy-{i}", model="sim-script",
            messages=[pb.Message(role="user", content=content)],
        )  # fmt: skip
        with contextlib.suppress(EdgeError):
            handles.append(
                await client.start_run(nursery, request, deadline=trio.current_time() + 120)
            )

    for i in range(count):
        nursery.start_soon(start, i)
    return handles


async def test_two_edges_wait_for_a_node_without_a_queue_rather_than_join_one(
    tmp_path: Path,
) -> None:
    """n1 and n2 each play 2 runs at once (`--max-runs 2`); another tenant holds n1's two
    places and 10 more runs wait in its queue. Two edge processes each send 8 requests at
    once: every one runs on n2, though n2 is full (2 runs from an edge) for most of them:
    a request waits at its edge for a place on n2 rather than join n1's queue, where it
    would wait behind 10 runs that never end. (Picking among the nodes with a slot here,
    an edge with n2 full would send its third request to n1.)"""
    with ExitStack() as stack:
        n1 = start_sim(tmp_path, "n1", "--name", "n1", "--max-runs", "2")
        stack.callback(stop_process, n1.process)
        n2 = start_sim(tmp_path, "n2", "--name", "n2", "--max-runs", "2")
        stack.callback(stop_process, n2.process)
        await _two_edges_ask(
            tmp_path, n1, n2, _busy_queued, QUEUED, "iop_edge_node_waiting_runs", QUEUED - 2
        )
