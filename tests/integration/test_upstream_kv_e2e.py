"""End to end: `iop-node` (a process) in front of a fake vLLM that publishes its KV events
in vLLM's and SGLang's wire formats (`kv_fixtures`), and edges (in this process, and
processes) whose cache-aware index of it is then exact.

Each fake server answers `/tokenize` and chat completions, keeps a prefix cache of
its own (`kv_fixtures.fakevllm`) and publishes its stores and evictions on a ZMQ
publisher that speaks vLLM's framing (`kv_fixtures.publisher`), which the tests also
make lose batches, forget them, or start a new life. Waits are bounded polls of what
the edge or the node reports, never durations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import trio

from edge.api.request import parse_chat_request
from edge.config import Config, NodeConfig, RoutingConfig, ServerConfig
from edge.node.wire import prepare_run_request
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    poll,
    start_edge,
    stop_edge,
    stop_process,
)
from tests.integration.edgeproc import edge_process
from tests.integration.kv_fixtures import sglang, vllm_maps, vllm_mixed, vllm_v0_9
from tests.integration.kv_fixtures.fakevllm import FakeVllm
from tests.integration.kv_fixtures.publisher import Publisher
from tests.integration.rawhttp import serve_upstream

CHAT = "/v1/chat/completions"
WAIT_S = 20.0


@dataclass
class Server:
    """A fake vLLM, its publisher and the iop-node in front of it."""

    fake: FakeVllm
    publisher: Publisher
    node: SimProcess
    log: Path

    def log_lines(self) -> list[str]:
        return self.log.read_text().splitlines()


def _start_node(tmp: Path, name: str, url: str, *args: str) -> tuple[SimProcess, Path]:
    """`iop-node --name NAME --upstream URL ARGS`, its stderr to a file, once it listens."""
    log, runs = tmp / f"{name}.log", tmp / f"{name}-runs.jsonl"
    command = [
        sys.executable, "-m", "edge.nodes.upstream", "--listen", "127.0.0.1:0", "--name", name,
        "--runs-log", str(runs), "--upstream", url, "--load-source", "none", *args,
    ]  # fmt: skip
    with log.open("w") as err:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    if "listening on" not in line:
        stop_process(process)
        raise RuntimeError(f"iop-node did not start: {log.read_text()}")
    return SimProcess(line.rsplit(" ", 1)[1].strip(), runs, process), log


@asynccontextmanager
async def _server(
    nursery: trio.Nursery, tmp: Path, name: str, fmt: ModuleType, *, events: bool = True,
    **fake: Any,
) -> AsyncIterator[Server]:  # fmt: skip
    """A fake vLLM publishing in `fmt`, and an iop-node in front of it (reading its events
    unless `events` is False); all stopped on the way out."""
    publisher = Publisher(fmt)
    try:
        server = FakeVllm(publisher, **fake)
        server.url = await serve_upstream(nursery, server.answer)
        flags = ("--kv-events", publisher.endpoint, "--kv-replay", publisher.replay)
        node, log = await trio.to_thread.run_sync(
            lambda: _start_node(tmp, name, server.url, *(flags if events else ()))
        )
        try:
            yield Server(server, publisher, node, log)
        finally:
            await trio.to_thread.run_sync(stop_process, node.process)
    finally:
        await trio.to_thread.run_sync(publisher.close)


def _body(group: int, question: str) -> dict[str, Any]:
    """A request of prefix group `group`: a long system prompt of its own, one question."""
    system = f"Group {group}: you answer in one short sentence, kindly and plainly. " * 25
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }


def _blocks(body: dict[str, Any]) -> list[int]:
    """The edge's prefix blocks of `body`, as it sends them."""
    request = parse_chat_request(json.dumps(body).encode())
    prepared = prepare_run_request(request, run_id="x", model=body["model"])
    assert prepared.prefix is not None
    return prepared.prefix.blocks.tolist()


def _config(*nodes: tuple[str, SimProcess]) -> Config:
    return Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
        routing=RoutingConfig(policy="cache_aware", watch_heartbeat_s=0.5),
        nodes=tuple(NodeConfig(name, node.address) for name, node in nodes),
    )


async def _held(running: RunningEdge, name: str, blocks: Sequence[int], at_least: int) -> int:
    """Once the edge's index of node `name` holds at least `at_least` of `blocks` as a
    prefix: how many it holds."""
    cache = running.node(name).cache
    await poll(lambda: cache.exact and cache.longest(blocks) >= at_least, WAIT_S)
    return cache.longest(blocks)


async def _gone(running: RunningEdge, name: str, blocks: Sequence[int]) -> None:
    """Once the edge's index of node `name` holds none of `blocks`."""
    cache = running.node(name).cache
    await poll(lambda: cache.longest(blocks) == 0, WAIT_S)
    assert cache.exact


async def _ask(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    answer = await http.post(CHAT, json=body)
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


async def _listening(http: httpx.AsyncClient, running: RunningEdge, name: str) -> None:
    """Until the node hears its server: requests of warm-up prompts until the edge's index
    holds one (a first batch may go before the node's subscription reaches the server)."""
    with trio.fail_after(WAIT_S):
        for n in range(100):
            body = _body(1000 + n, "warm up")
            await _ask(http, body)
            cache, blocks = running.node(name).cache, _blocks(body)
            with trio.move_on_after(1):
                while not cache.longest(blocks):  # noqa: ASYNC110 - no event to wait on
                    await trio.sleep(0.01)
                return
    raise AssertionError("the node never reported a block")


async def test_stores_removals_and_a_clear_keep_the_edges_index_what_the_server_holds(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A run's prompt stored by the server makes the edge's index of the node hold its
    prefix (`/readyz` says `exact`), every block but those the server's partial last block
    covers; the server evicting them takes them out, a run stores them again, and
    `AllBlocksCleared` takes everything out. Each run was tokenized once."""
    async with _server(nursery, tmp_path, "n1", vllm_maps) as server:
        running = await start_edge(nursery, _config(("n1", server.node)))
        try:
            async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as http:
                ready = (await http.get("/readyz")).json()
                assert ready["nodes"][0]["cache"]["index"] == "exact"
                await _listening(http, running, "n1")
                body = _body(1, "What is the capital of France?")
                blocks = _blocks(body)
                answer = await _ask(http, body)
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                held = await _held(running, "n1", blocks, len(blocks) - 1)
                server.fake.evict(len(server.fake.cache))
                await _gone(running, "n1", blocks)
                await _ask(http, body)
                assert await _held(running, "n1", blocks, held) == held
                server.fake.clear()
                await _gone(running, "n1", blocks)
                runs = len([r for r in server.node.runs() if "outcome" in r])
                assert server.fake.tokenizes == runs
        finally:
            await stop_edge(running)


@pytest.mark.parametrize("fmt", [vllm_v0_9, sglang], ids=["vllm-0.9", "sglang"])
async def test_a_gap_is_replayed_and_one_the_replay_cannot_fill_resets(
    nursery: trio.Nursery, tmp_path: Path, fmt: ModuleType
) -> None:
    """A batch lost on the way (the publisher kept it) is asked of the replay endpoint when
    the next one shows the gap: both runs' prefixes are held. A lost batch the publisher
    no longer holds resets the node's index: what it held before is out (the edge's
    index is told by a snapshot), the run after the gap is in, and the lost run's prefix
    is not claimed."""
    async with _server(nursery, tmp_path, "n1", fmt) as server:
        running = await start_edge(nursery, _config(("n1", server.node)))
        try:
            async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as http:
                await _listening(http, running, "n1")
                lost, after = _body(2, "lost"), _body(3, "after")
                server.publisher.drop(1)
                await _ask(http, lost)
                await _ask(http, after)
                for body in (lost, after):
                    await _held(running, "n1", _blocks(body), 1)
                assert server.publisher.replays == 1
                forgotten, later = _body(4, "forgotten"), _body(5, "later")
                server.publisher.drop(1)
                await _ask(http, forgotten)
                server.publisher.forget()
                await _ask(http, later)
                await _held(running, "n1", _blocks(later), 1)
                for body in (lost, after, forgotten):
                    await _gone(running, "n1", _blocks(body))
                assert server.publisher.replays == 2
        finally:
            await stop_edge(running)


async def test_a_restarted_server_resets_the_nodes_index(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The server restarts (a new hash seed, an empty cache, its events numbered from 0
    again): the node resets its index at the new life's first batch, so the prefixes
    of before are out, and the new run's is in."""
    async with _server(nursery, tmp_path, "n1", vllm_mixed) as server:
        running = await start_edge(nursery, _config(("n1", server.node)))
        try:
            async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as http:
                await _listening(http, running, "n1")
                before, after = _body(6, "before"), _body(7, "after")
                await _ask(http, before)
                await _held(running, "n1", _blocks(before), 1)
                server.fake.restart()
                await _ask(http, after)
                await _held(running, "n1", _blocks(after), 1)
                await _gone(running, "n1", _blocks(before))
                await poll(lambda: any("kv index: reset" in x for x in server.log_lines()))
        finally:
            await stop_edge(running)


async def test_without_events_the_index_stays_approximate_and_the_node_says_so(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """iop-node without `--kv-events` says at start that the edge's index of it is
    approximate, and `/readyz` says so; with them, it names the publisher."""
    async with (
        _server(nursery, tmp_path, "plain", vllm_maps, events=False) as plain,
        _server(nursery, tmp_path, "exact", vllm_maps) as exact,
    ):
        told = f"iop-node: kv index: exact from {exact.publisher.endpoint}"
        # Another process's stderr, written after it said it listens: polled, bounded.
        await poll(lambda: "iop-node: kv index: approximate (no --kv-events)" in
                   plain.log_lines() and told in exact.log_lines(), WAIT_S)  # fmt: skip
        running = await start_edge(nursery, _config(("plain", plain.node)))
        try:
            async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as http:
                await _ask(http, _body(8, "hi"))
                ready = (await http.get("/readyz")).json()
                assert ready["nodes"][0]["cache"]["index"] == "approximate"
        finally:
            await stop_edge(running)


@pytest.mark.parametrize(
    "fake", [{"token_strs": False}, {"tokenize_status": 422}], ids=["no-token-strs", "sglang"]
)
async def test_a_server_whose_tokens_cannot_be_placed_leaves_runs_unmapped_and_says_so(
    nursery: trio.Nursery, tmp_path: Path, fake: dict[str, Any]
) -> None:
    """A server whose `/tokenize` gives no token strings (a vLLM before them), or takes no
    chat messages (SGLang's): each run is answered as ever, the node warns once that
    runs are sent unmapped, and claims nothing of them."""
    async with _server(nursery, tmp_path, "n1", sglang, **fake) as server:
        running = await start_edge(nursery, _config(("n1", server.node)))
        try:
            async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as http:
                bodies = [_body(9, "one"), _body(10, "two")]
                for body in bodies:
                    await _ask(http, body)
                await poll(lambda: any("sent unmapped" in x for x in server.log_lines()))
                warned = [x for x in server.log_lines() if "WARNING" in x and "unmapped" in x]
                assert len(warned) == 1, warned
                assert server.fake.tokenizes == 2
                cache = running.node("n1").cache
                assert cache.exact
                assert all(cache.longest(_blocks(body)) == 0 for body in bodies)
        finally:
            await stop_edge(running)


def _edge_toml(*nodes: tuple[str, SimProcess]) -> str:
    listed = "".join(f'[[nodes]]\nname = "{n}"\naddress = "{p.address}"\n' for n, p in nodes)
    return (
        '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'
        '[routing]\npolicy = "cache_aware"\nwatch_heartbeat_s = 0.5\n' + listed
    )


async def _readyz_held(http: httpx.AsyncClient, name: str) -> int:
    ready = (await http.get("/readyz")).json()
    node = next(n for n in ready["nodes"] if n["name"] == name)
    assert node["cache"]["index"] == "exact"
    held: int = node["cache"]["held_blocks"]
    return held


async def test_a_prefix_another_edge_placed_is_routed_to_the_node_holding_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Two iop-nodes (vLLM's and SGLang's formats) and three edge processes: each of 4
    prefix groups is first asked through an edge that has only one of the nodes
    (alternately), then through the edge that has both, whose index of the nodes comes
    from their KV events alone: it sends each group's next question to the node that
    holds its prefix, where the server finds it cached. (The servers' caches are large
    enough that nothing is evicted: `/readyz` counts what the index holds.)"""
    async with (
        _server(nursery, tmp_path, "n1", vllm_maps, capacity=4096) as one,
        _server(nursery, tmp_path, "n2", sglang, capacity=4096) as two,
    ):
        servers = {"n1": one, "n2": two}
        async with (
            edge_process(tmp_path, _edge_toml(("n1", one.node), ("n2", two.node))) as both,
            edge_process(tmp_path, _edge_toml(("n1", one.node)), name="only1") as only1,
            edge_process(tmp_path, _edge_toml(("n2", two.node)), name="only2") as only2,
            httpx.AsyncClient(base_url=both.url, timeout=WAIT_S) as http,
            httpx.AsyncClient(base_url=only1.url, timeout=WAIT_S) as http1,
            httpx.AsyncClient(base_url=only2.url, timeout=WAIT_S) as http2,
        ):
            for name, client in (("n1", http1), ("n2", http2)):
                with trio.fail_after(WAIT_S):
                    n = 0
                    while await _readyz_held(http, name) == 0:
                        await _ask(client, _body(2000 + n, "warm up"))
                        n += 1
            for group in range(4):
                name, client = ("n1", http1) if group % 2 == 0 else ("n2", http2)
                before = await _readyz_held(http, name)
                await _ask(client, _body(group, "the first question"))
                grown = before + len(_blocks(_body(group, "q"))) - 1
                with trio.fail_after(WAIT_S):
                    while await _readyz_held(http, name) < grown:  # noqa: ASYNC110
                        await trio.sleep(0.05)  # another process's report: poll, bounded
                answer = await _ask(http, _body(group, "the second question"))
                run_id = answer["id"].removeprefix("chatcmpl-")
                await servers[name].node.wait_run(run_id, WAIT_S)
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
