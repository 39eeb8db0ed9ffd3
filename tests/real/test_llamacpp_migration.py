"""An answer whose llama.cpp server (or its iop-node) dies mid-stream goes on on another
one, and the client's text is the answer it would have had uncut.

Two llama-servers with the same model, an iop-node in front of each (`--continuation
auto`: the probe finds that llama.cpp continues), an edge in front of both. Greedy
decoding makes the uncut answer one text: the same request to a server directly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.config import Config, NodeConfig, ServerConfig
from tests.integration.conftest import (
    SimProcess,
    kill_process,
    poll,
    start_edge,
    start_upstream_node,
    stop_edge,
    stop_process,
)
from tests.real import llamacpp
from tests.real.conftest import NODE_ARGS
from tests.real.llamacpp import MODEL_NAME, LlamaServer

# Output tokens of the answer; the kill comes after CUT_AT characters of it.
MAX_TOKENS = 300
CUT_AT = 200


@dataclass
class Pair:
    """A llama-server and the iop-node in front of it."""

    llama: LlamaServer
    node: SimProcess


@pytest.fixture
def pairs(llama_binary: Path, tiny_model: Path, tmp_path: Path) -> Iterator[tuple[Pair, Pair]]:
    with ExitStack() as stack:
        made = []
        for name in ("a", "b"):
            server = llamacpp.start(llama_binary, tiny_model, tmp_path / f"llama-{name}.log")
            stack.callback(server.stop)
            node = start_upstream_node(
                tmp_path / f"node-{name}.jsonl", server.url, *NODE_ARGS, "--name", name
            )
            stack.callback(stop_process, node.process)
            made.append(Pair(server, node))
        yield made[0], made[1]


def _body() -> dict[str, Any]:
    return {
        "model": MODEL_NAME, "temperature": 0, "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": "Write a long story about the sea."}],
    }  # fmt: skip


async def _uncut(llama: LlamaServer) -> str:
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(llama.url + "/chat/completions", json=_body())
    return str(response.json()["choices"][0]["message"]["content"])


def _serving(pairs: tuple[Pair, Pair]) -> Pair:
    """The pair whose server is generating (the one the answer is on)."""
    (pair,) = [p for p in pairs if p.llama.busy_slots()]
    return pair


async def _migrated(nursery: trio.Nursery, pairs: tuple[Pair, Pair], kill: str) -> str:
    """The text a streaming client gets from an edge in front of both pairs when, after
    CUT_AT characters, the serving pair's `kill` ("llama" or "node") is killed."""
    config = Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
        nodes=tuple(NodeConfig(name, p.node.address) for name, p in zip("ab", pairs, strict=True)),
    )
    edge = await start_edge(nursery, config)
    # Each iop-node has asked its server whether it continues answers (`auto`).
    await poll(lambda: all(MODEL_NAME in edge.node(n).continuation_models for n in "ab"))
    text = ""
    killed = False
    async with (
        httpx.AsyncClient(base_url=edge.url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json={**_body(), "stream": True}) as r,
    ):
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices") or ():
                text += choice["delta"].get("content") or ""
            if not killed and len(text) >= CUT_AT:
                killed = True
                serving = await trio.to_thread.run_sync(_serving, pairs)
                if kill == "llama":
                    await trio.to_thread.run_sync(serving.llama.kill)
                else:
                    await trio.to_thread.run_sync(kill_process, serving.node.process)
    assert killed
    assert edge.counted("iop_edge_migrations_total", outcome="migrated") == 1
    await stop_edge(edge)
    return text


@pytest.mark.parametrize("kill", ["llama", "node"])
async def test_an_answer_cut_by_a_dead_server_continues_whole(
    nursery: trio.Nursery, pairs: tuple[Pair, Pair], kill: str
) -> None:
    """Its server (or its iop-node) killed mid-answer, the answer goes on on the other
    pair: the client's text is byte for byte the uncut answer, neither started over (an
    echo of what was sent) nor cut."""
    uncut = await _uncut(pairs[0].llama)
    assert len(uncut) > 2 * CUT_AT
    text = await _migrated(nursery, pairs, kill)
    if text != uncut:
        at = next((i for i, (x, y) in enumerate(zip(text, uncut, strict=False)) if x != y), 0)
        raise AssertionError(
            f"the migrated answer ({len(text)} characters) parts from the uncut one"
            f" ({len(uncut)}) at {at}: {text[at - 40 : at + 40]!r} != {uncut[at - 40 : at + 40]!r}"
        )
