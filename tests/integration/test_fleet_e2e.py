"""The pool's side of a fleet over real node processes: fast recovery, the circuit
breaker, panic routing, and what /readyz and /metrics show of each node.

The run side (failover, the verdict of each run fed to the pool) is another
module's; where a test needs a run's verdict without it, it runs the node
client itself and reports the verdict to the pool as the run side does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.config import Config, NodeConfig, RoutingConfig, ServerConfig
from edge.contract._proto.iop.node import v1 as pb
from edge.errors import NodeUnavailableError
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.node.bridge import asyncio_loop
from edge.node.client import GrpcNodeClient, NodeSocket
from edge.stream.events import Complete, Failed, NodeEvent
from tests.integration.conftest import (
    SimProcess,
    chat_body,
    edge_config,
    node_events,
    script,
    start_edge,
    stop_edge,
)
from tests.integration.edgeproc import free_port, kill, start_sim_on
from tests.integration.test_ops_e2e import scrape

CHAT = "/v1/chat/completions"
WAIT_S = 10.0
FAIL = script({"type": "error", "error": "the model fell over"})
OK = script({"type": "delta", "delta": "x"}, {"type": "complete"})


async def _node_state(http: httpx.AsyncClient, name: str) -> str:
    nodes: list[dict[str, Any]] = (await http.get("/readyz")).json()["nodes"]
    return str(next(n for n in nodes if n["name"] == name)["state"])


def _on_available(pool: NodePool) -> trio.Event:
    """An event set the next time the pool says a node may take runs again (whoever else
    listens, the admission queue, is still told)."""
    event = trio.Event()
    before = pool.on_available

    def available() -> None:
        event.set()
        if before is not None:
            before()

    pool.on_available = available
    return event


async def test_a_restarted_node_serves_again_soon_after_it_listens(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A node killed and restarted on its address serves again without waiting for the
    refresh interval (30 s here): the refused run marks it down at once (a 503 before any
    byte, state `down`, gauge 0), it is probed with backoff (0.25 s, 0.5 s, then every
    second), and once it listens the next probe brings it back (state `up`, gauge 1) and
    a request succeeds. A bounded poll, not a timing assertion (`make chaos` times it)."""
    port = free_port()
    runs_log = tmp_path / "runs.jsonl"
    node = await trio.to_thread.run_sync(start_sim_on, port, runs_log)
    try:
        sim = SimProcess(f"127.0.0.1:{port}", runs_log, node)
        config = edge_config(sim)
        config = replace(config, server=replace(config.server, node_refresh_s=30))
        running = await start_edge(nursery, config)
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            assert (await http.post(CHAT, json=chat_body("sim-echo", "before"))).status_code == 200

            kill(node)
            refused = await http.post(CHAT, json=chat_body("sim-echo", "while down"))
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "node_unavailable"
            assert await _node_state(http, "sim") == "down"
            assert (await scrape(http)).value("iop_edge_node_state", node="sim") == 0

            came_up = _on_available(running.edge.pool)
            node = await trio.to_thread.run_sync(start_sim_on, port, runs_log)
            with trio.fail_after(WAIT_S):  # probes: within a second of listening, not 30 s
                await came_up.wait()
            assert await _node_state(http, "sim") == "up"
            assert (await scrape(http)).value("iop_edge_node_state", node="sim") == 1
            again = await http.post(CHAT, json=chat_body("sim-echo", "after restart"))
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["message"]["content"] == "after restart"
        await stop_edge(running)
    finally:
        kill(node)


async def _run(state: NodeState, run_id: str, content: str) -> list[NodeEvent]:
    """One run of sim-script on `state`'s node, read to its end, as the run side would."""
    request = pb.RunRequest(
        run_id=run_id, model="sim-script", messages=[pb.Message(role="user", content=content)]
    )
    with trio.fail_after(WAIT_S):
        async with trio.open_nursery() as nursery:
            deadline = trio.current_time() + WAIT_S
            handle = await state.client.start_run(nursery, request, deadline=deadline)
            events = await node_events(handle)
    return events


@pytest.fixture
async def pool(sim: SimProcess) -> AsyncIterator[NodePool]:
    """A pool of one real node (the session's sim), breaker: 3 failures, 0.2 s cooldown."""
    host, port = sim.address.rsplit(":", 1)
    routing = RoutingConfig(breaker_failures=3, breaker_cooldown_s=0.2)
    async with asyncio_loop():
        nodes = NodePool(
            [GrpcNodeClient("sim", NodeSocket.tcp(host, int(port)))], routing=routing, refresh_s=30
        )
        try:
            await nodes.feed.refresh()
            yield nodes
        finally:
            await nodes.aclose()


async def test_the_breaker_opens_after_failed_runs_and_half_opens_for_one_probe(
    pool: NodePool,
) -> None:
    """Three runs that fail on a real node (an `error` event before any output) open its
    breaker: no run is given to it, not even by panic routing. The pool's background task
    half-opens it after the cooldown and says so (`on_available`); exactly one probe run
    may start; its success closes the breaker."""
    available = trio.Event()
    pool.on_available = available.set
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.feed.run_refresh)
        for i in range(3):
            state = pool.pick("sim-script")
            assert state is not None
            assert pool.state_of(state) == "up"
            events = await _run(state, f"breaker-fail-{i}", FAIL)
            assert isinstance(events[-1], Failed)
            pool.run_failed(state, "error_event")
        assert pool.state_of(state) == "open"
        with pytest.raises(NodeUnavailableError, match="circuit"):
            pool.pick("sim-script")

        with trio.fail_after(WAIT_S):
            await available.wait()
        assert pool.state_of(state) == "half_open"
        probe = pool.pick("sim-script")
        assert probe is state
        with pytest.raises(NodeUnavailableError):
            pool.pick("sim-script")  # the probe is out
        events = await _run(probe, "breaker-probe", OK)
        assert isinstance(events[-1], Complete)
        pool.run_succeeded(probe)
        assert pool.state_of(state) == "up"
        assert pool.pick("sim-script") is state
        nursery.cancel_scope.cancel()


async def test_a_failed_probe_opens_the_breaker_again(pool: NodePool) -> None:
    """Half-open, the probe run fails on the node: open again, then half-open again after
    another cooldown."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.feed.run_refresh)
        state = pool.nodes[0]
        for _ in range(3):
            pool.run_failed(state, "error_event")
        available = trio.Event()
        pool.on_available = available.set
        with trio.fail_after(WAIT_S):
            await available.wait()
        probe = pool.pick("sim-script")
        assert probe is state
        assert isinstance((await _run(probe, "probe-fails", FAIL))[-1], Failed)
        pool.run_failed(probe, "error_event")
        assert pool.state_of(state) == "open"
        available = trio.Event()
        pool.on_available = available.set
        with trio.fail_after(WAIT_S):
            await available.wait()
        assert pool.state_of(state) == "half_open"
        nursery.cancel_scope.cancel()


def _fleet_config(sim: SimProcess, dead: str, **routing: Any) -> Config:
    return Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0, node_refresh_s=30),
        routing=RoutingConfig(**routing),
        nodes=(NodeConfig("sim", sim.address), NodeConfig("dead", dead)),
    )


async def test_readyz_and_metrics_show_each_nodes_state(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """/readyz lists every node with its state, and iop_edge_node_state has its number:
    a node that never answered is `down` (0); a live one `up` (1), `open` (3) once its
    breaker opened, when /readyz is 503 with the reason and a request for its models is a
    503 before any byte; `up` again once a run on it succeeded."""
    config = _fleet_config(
        sim, f"127.0.0.1:{free_port()}", breaker_failures=2, breaker_cooldown_s=600
    )
    running = await start_edge(nursery, config)
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        ready = await http.get("/readyz")
        assert ready.status_code == 200
        states = {n["name"]: n["state"] for n in ready.json()["nodes"]}
        assert states == {"sim": "up", "dead": "down"}
        metrics = await scrape(http)
        assert metrics.value("iop_edge_node_state", node="sim") == 1
        assert metrics.value("iop_edge_node_state", node="dead") == 0

        sim_state = running.node("sim")
        for _ in range(2):
            running.edge.pool.run_failed(sim_state, "error_event")  # as the run side reports
        ready = await http.get("/readyz")
        assert ready.status_code == 503
        assert "circuit breaker" in ready.json()["reason"]
        node = next(n for n in ready.json()["nodes"] if n["name"] == "sim")
        assert (node["state"], node["failed_runs_in_a_row"]) == ("open", 2)
        assert (await scrape(http)).value("iop_edge_node_state", node="sim") == 3
        refused = await http.post(CHAT, json=chat_body("sim-echo", "x", stream=True))
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "node_unavailable"

        running.edge.pool.run_succeeded(sim_state)
        assert await _node_state(http, "sim") == "up"
        answer = await http.post(CHAT, json=chat_body("sim-echo", "back"))
        assert answer.status_code == 200, answer.text
    await stop_edge(running)


async def test_panic_routing_sends_to_a_node_marked_down(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """The only node serving a model is marked down (a refusal that was a blip): the edge
    still tries it rather than answer 503, and the request succeeds."""
    running = await start_edge(nursery, edge_config(sim))
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        pool = running.edge.pool
        state = running.node("sim")
        pool.mark_down(state, "a refusal that was a blip")
        assert pool.state_of(state) == "down"
        assert pool.pick("sim-echo") is state  # panic routing, before any probe ran
        answer = await http.post(CHAT, json=chat_body("sim-echo", "anyway"))
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == "anyway"
    await stop_edge(running)
