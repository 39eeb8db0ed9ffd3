"""Cache-aware routing over real processes: edges in front of simulated nodes.

Most need only what any node does (the edge sends the prefix blocks, the
rendezvous placement and the approximate index work with any node): a
node's cached input tokens come from a sim-script's usage there. The last
runs the simulated node's KV cache model (`--kv-tokens`), whose Watch
reports feed each edge's exact index.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import trio

from edge.config import Config, NodeConfig, RoutingConfig, ServerConfig
from edge.contract.prefix import BLOCK_TOKENS
from tests.integration.conftest import (
    SimProcess,
    named_sims,
    node_that_ran,
    script,
    start_edge,
    start_sim,
    stop_edge,
    stop_process,
)
from tests.integration.edgeproc import edge_process

CHAT = "/v1/chat/completions"
WAIT_S = 30.0
NAMES = ("n1", "n2", "n3")


PREFIXES = 8
ALL_CACHED = 1_000_000  # cached input tokens: more than any prompt here


def _edge_toml(nodes: tuple[SimProcess, ...]) -> str:
    listed = "".join(
        f'[[nodes]]\nname = "{name}"\naddress = "{node.address}"\n'
        for name, node in zip(NAMES, nodes, strict=True)
    )
    return (
        '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'
        '[routing]\npolicy = "cache_aware"\nwatch_heartbeat_s = 0.5\n' + listed
    )


def _conversation(group: int, question: str) -> dict[str, Any]:
    """A request of prefix group `group`: a long system prompt of its own, one question."""
    system = f"Group {group}: you answer in one short sentence. " * 40
    return {
        "model": "sim-echo",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }


async def test_two_edge_processes_send_each_new_prefix_to_the_same_node(
    tmp_path: Path,
) -> None:
    """Two edge processes in front of the same three nodes, with nothing shared between
    them: for each of 8 new prefixes, its first request through one edge and its next
    through the other run on the same node (rendezvous of the first block, then the
    index); the prefixes spread over more than one node."""
    with named_sims(tmp_path, *NAMES) as nodes:
        toml = _edge_toml(nodes)
        placed: dict[int, str] = {}
        async with (
            edge_process(tmp_path, toml, name="edge1") as edge1,
            edge_process(tmp_path, toml, name="edge2") as edge2,
            httpx.AsyncClient(base_url=edge1.url, timeout=WAIT_S) as http1,
            httpx.AsyncClient(base_url=edge2.url, timeout=WAIT_S) as http2,
        ):
            for group in range(PREFIXES):
                first, second = (http1, http2) if group % 2 else (http2, http1)
                one = await first.post(CHAT, json=_conversation(group, "first question"))
                two = await second.post(CHAT, json=_conversation(group, "second question"))
                assert one.status_code == two.status_code == 200, (one.text, two.text)
                placed[group] = await node_that_ran(NAMES, nodes, one)
                assert await node_that_ran(NAMES, nodes, two) == placed[group], group
        assert len(set(placed.values())) > 1, placed


def _scripted(group: int, cached_tokens: int) -> dict[str, Any]:
    """A request of prefix group `group` whose node says it had `cached_tokens` cached."""
    usage = {"input_tokens": 1000, "output_tokens": 1, "cached_input_tokens": cached_tokens}
    body = _conversation(group, script({"type": "delta", "delta": "ok"},
                                       {"type": "complete", "usage": usage}))  # fmt: skip
    body["model"] = "sim-script"
    return body


async def test_a_run_that_found_less_cached_corrects_the_index_and_the_metrics_say_so(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Through a real edge and node: the second request of a prefix is predicted a hit;
    its run says nothing was cached (usage.cached_input_tokens 0), so the index drops
    the prefix on that node and the third request is a miss again (placed by
    rendezvous on the same node). A run that says all was cached keeps it. The
    routing counters and the predicted tokens show each step."""
    with named_sims(tmp_path, "n1", "n2") as (n1, n2):
        config = Config(
            server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
            routing=RoutingConfig(policy="cache_aware"),
            nodes=(NodeConfig("n1", n1.address), NodeConfig("n2", n2.address)),
        )
        running = await start_edge(nursery, config)
        try:
            async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as http:

                async def ask(cached: int) -> None:
                    answer = await http.post(CHAT, json=_scripted(1, cached))
                    assert answer.status_code == 200, answer.text
                    await running.wait_idle()  # its outcome (and usage) are counted

                def sample(name: str, **labels: str) -> float | None:
                    registry = running.edge.metrics.registry
                    return registry.get_sample_value(name, labels)

                await ask(0)
                held = [s for s in running.edge.pool.nodes if len(s.cache)]
                assert len(held) == 1  # a miss: predicted 0, nothing to correct
                node = held[0]
                first = len(node.cache)
                await ask(0)  # a hit: predicted every block, the node says none: dropped
                assert len(node.cache) == 0
                await ask(ALL_CACHED)  # a miss again (same node), then all of it cached
                again = len(node.cache)
                assert again > 0
                await ask(ALL_CACHED)  # a hit, confirmed: kept
                assert len(node.cache) == again
                routed = "iop_edge_cache_routing_total"
                assert sample(routed, outcome="hit") == 2
                assert sample(routed, outcome="miss") == 2
                tokens = sample("iop_edge_cache_predicted_tokens_total", node=node.client.name)
                assert tokens == (first + again) * BLOCK_TOKENS
        finally:
            await stop_edge(running)


async def test_with_the_nodes_kv_cache_the_next_turn_through_another_edge_is_cached(
    tmp_path: Path,
) -> None:
    """Three nodes with the simulated KV cache (`--kv-tokens`), two edge processes in
    front of them: for each of 4 prefixes, the first request (through one edge) finds
    nothing cached; the next one, a different question after the same system prompt,
    through the other edge, runs on the same node and finds the whole system prompt
    cached there (`usage.prompt_tokens_details.cached_tokens`, as the node counted it)."""
    with ExitStack() as stack:
        nodes = []
        for name in NAMES:
            node = start_sim(
                tmp_path, name, "--name", name, "--kv-tokens", "65536",
                "--prefill-us-per-token", "0",
            )  # fmt: skip
            stack.callback(stop_process, node.process)
            nodes.append(node)
        sims = tuple(nodes)
        toml = _edge_toml(sims)
        async with (
            edge_process(tmp_path, toml, name="edge1") as edge1,
            edge_process(tmp_path, toml, name="edge2") as edge2,
            httpx.AsyncClient(base_url=edge1.url, timeout=WAIT_S) as http1,
            httpx.AsyncClient(base_url=edge2.url, timeout=WAIT_S) as http2,
        ):
            for group in range(4):
                first, second = (http1, http2) if group % 2 else (http2, http1)
                one = await first.post(CHAT, json=_conversation(group, "first question"))
                two = await second.post(CHAT, json=_conversation(group, "second question"))
                assert one.status_code == two.status_code == 200, (one.text, two.text)
                ran = [await node_that_ran(NAMES, sims, answer) for answer in (one, two)]
                assert ran[0] == ran[1], group
                cached = [
                    a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in (one, two)
                ]
                system_tokens = len(_conversation(group, "")["messages"][0]["content"]) // 4
                assert cached[0] == 0, cached
                assert system_tokens - 2 * BLOCK_TOKENS <= cached[1] <= system_tokens, cached
