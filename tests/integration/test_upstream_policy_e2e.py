"""`iop-node` forwards only what the edge's policy allows, whoever calls it: real processes.

An `iop-node` process in front of a small OpenAI-compatible server (`Recorder`, real
sockets on 127.0.0.1) that records every chat completion it is asked for, called
directly over gRPC (no edge, as anyone who reaches the node's port could):

- a run with an `http://169.254.169.254/` image, or `max_tokens` 4,000,000,000, ends
  with an error event of `http_status` 400 whose words name the field, and the
  server is asked nothing;
- a run with `chat_template_kwargs.chat_template`, or `ignore_eos`, is answered, the
  server receiving it without that field;
- with `--allow-chat-template --allow-ignore-eos --media-url-schemes data,http
  --max-output-tokens N` all four reach the server as sent.

Through an edge whose model allows http media, a node's policy refusal is the request's
fault: a 400 with the node's words, run once (no failover), no breaker counting it.
Nothing asserts a duration; waits are on events, or bounded polls of another
process's runs log.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import h11
import httpx
import trio
from grpclib.client import Channel

from edge.config import Config, ModelConfig, NodeConfig, RoutingConfig, ServerConfig
from edge.contract._proto.iop.node import v1 as pb
from edge.node.bridge import asyncio_loop, call_asyncio
from tests.integration.conftest import (
    SimProcess,
    poll,
    start_edge,
    start_upstream_node,
    stop_edge,
    stop_process,
)
from tests.integration.rawhttp import read_request, send_whole, serve_upstream

WAIT_S = 20.0
METADATA_URL = "http://169.254.169.254/latest/meta-data/"
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@dataclass
class Recorder:
    """An OpenAI-compatible server that answers every chat completion "fine", streamed,
    and keeps each request's body and headers (names in lower case)."""

    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)


# The one answer: "fine", streamed.
ANSWER = (
    b"".join(
        f"data: {json.dumps(chunk)}\n\n".encode()
        for chunk in (
            {"choices": [{"index": 0, "delta": {"content": "fine"}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        )
    )
    + b"data: [DONE]\n\n"
)


async def _serve(recorder: Recorder, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    async with stream:
        try:
            while (received := await read_request(stream, conn)) is not None:
                request, body = received
                if request.target == b"/v1/models":
                    models = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
                    await send_whole(stream, conn, 200, models)
                elif request.target != b"/v1/chat/completions":  # its /metrics: none
                    await send_whole(stream, conn, 404, b'{"detail":"Not Found"}')
                else:
                    recorder.bodies.append(json.loads(body))
                    recorder.headers.append({k.decode(): v.decode() for k, v in request.headers})
                    await send_whole(stream, conn, 200, ANSWER, "text/event-stream")
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, h11.ProtocolError):
            return


async def _recorder(nursery: trio.Nursery) -> Recorder:
    recorder = Recorder()
    recorder.url = await serve_upstream(nursery, partial(_serve, recorder))
    return recorder


@asynccontextmanager
async def _node(recorder: Recorder, runs_log: Path, *args: str) -> AsyncIterator[SimProcess]:
    """`iop-node` in front of `recorder`, with its upstream key set (it must never carry
    a refused run)."""
    node = await trio.to_thread.run_sync(
        partial(
            start_upstream_node, runs_log, recorder.url, "--models", "m",
            "--api-key-env", "IOP_TEST_UPSTREAM_KEY", *args,
            env={"IOP_TEST_UPSTREAM_KEY": "sk-node-own"},
        )
    )  # fmt: skip
    try:
        yield node
    finally:
        stop_process(node.process)


def _image(url: str) -> pb.ContentPart:
    part = {"type": "image_url", "image_url": {"url": url}}
    return pb.ContentPart(type="image_url", json=json.dumps(part))


def _run(run_id: str, *parts: pb.ContentPart, extra: Any = None, **fields: Any) -> pb.RunRequest:
    text = pb.ContentPart(type="text", text="hi")
    return pb.RunRequest(
        run_id=run_id,
        model="m",
        messages=[pb.Message(role="user", parts=[text, *parts])],
        extra_json=json.dumps(extra) if extra is not None else "",
        **fields,
    )


HOSTILE = {
    "image": _run("image", _image(METADATA_URL)),
    "tokens": _run("tokens", max_tokens=4_000_000_000),
    "template": _run("template", extra={"chat_template_kwargs": {"chat_template": TEMPLATE}}),
    "eos": _run("eos", extra={"ignore_eos": True}),
}


async def _call(address: str, requests: list[pb.RunRequest]) -> list[list[pb.RunEvent]]:
    """Each run's events, one run after the other, over one channel (on asyncio)."""
    host, port = address.rsplit(":", 1)
    channel = Channel(host, int(port))
    try:
        stub = pb.NodeServiceStub(channel)
        return [[event async for event in stub.run(request)] for request in requests]
    finally:
        channel.close()


async def run_all(node: SimProcess, *requests: pb.RunRequest) -> list[list[pb.RunEvent]]:
    async with asyncio_loop():
        with trio.fail_after(WAIT_S):
            return await call_asyncio(_call, node.address, list(requests))


async def test_a_node_refuses_or_drops_what_the_edge_would(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Called directly, a node with the default policy ends the image and the token runs
    with a 400 naming the field, asking its server nothing; it answers the template and
    ignore_eos runs, whose bodies reach the server without those fields."""
    recorder = await _recorder(nursery)
    async with _node(recorder, tmp_path / "runs.jsonl") as node:
        image, tokens = await run_all(node, HOSTILE["image"], HOSTILE["tokens"])
        for events, field_name in ((image, "image_url.url"), (tokens, "max_tokens")):
            assert len(events) == 1, events
            (event,) = events
            assert (event.type, event.http_status, event.error) == ("error", 400, "invalid_value")
            assert field_name in event.message
        assert recorder.bodies == []
        template, eos = await run_all(node, HOSTILE["template"], HOSTILE["eos"])
        assert [e.type for e in template] == ["delta", "complete"]
        assert [e.type for e in eos] == ["delta", "complete"]
        assert len(recorder.bodies) == 2
        sent_template, sent_eos = recorder.bodies
        assert "chat_template_kwargs" not in sent_template
        assert "chat_template" not in sent_template
        assert "ignore_eos" not in sent_eos
        assert all(h["authorization"] == "Bearer sk-node-own" for h in recorder.headers)
        await node.wait_run("eos")
        outcomes = {r["run_id"]: r["outcome"] for r in node.runs() if "outcome" in r}
        assert outcomes == {
            "image": "error", "tokens": "error", "template": "complete", "eos": "complete",
        }  # fmt: skip


async def test_the_allow_flags_let_it_all_through(nursery: trio.Nursery, tmp_path: Path) -> None:
    """With the policy opened by flags, each of the four runs reaches the server as sent."""
    recorder = await _recorder(nursery)
    flags = (
        "--allow-chat-template", "--allow-ignore-eos", "--media-url-schemes", "data,http",
        "--max-output-tokens", str(2**32 - 1),
    )  # fmt: skip
    async with _node(recorder, tmp_path / "runs.jsonl", *flags) as node:
        answers = await run_all(node, *HOSTILE.values())
        assert [[e.type for e in events] for events in answers] == [["delta", "complete"]] * 4
    image, tokens, template, eos = recorder.bodies
    assert image["messages"][0]["content"][1]["image_url"]["url"] == METADATA_URL
    assert tokens["max_tokens"] == 4_000_000_000
    assert template["chat_template_kwargs"] == {"chat_template": TEMPLATE}
    assert eos["ignore_eos"] is True


async def test_a_nodes_policy_refusal_is_the_requests_fault_at_the_edge(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """An edge whose model allows http media sends such a request to a node whose policy
    does not: the client gets a 400 with the node's words, the run is tried on one node
    only (the other node's runs log stays empty), counted as a refusal, not as a node
    error or a retry; both nodes stay up and the server was asked nothing."""
    recorder = await _recorder(nursery)
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(_node(recorder, tmp_path / f"{name}-runs.jsonl"))
            for name in "ab"
        ]
        config = Config(
            server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
            routing=RoutingConfig(retries=2, retry_backoff_s=0.01),
            nodes=tuple(NodeConfig(name, n.address) for name, n in zip("ab", nodes, strict=True)),
            models={"m": ModelConfig(media_url_schemes=("data", "http"))},
        )
        edge = await start_edge(nursery, config)
        try:
            async with httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http:
                content = [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": METADATA_URL}},
                ]
                body = {"model": "m", "messages": [{"role": "user", "content": content}]}
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error"
                assert "messages[0].content[1].image_url.url" in error["message"]
                await edge.wait_idle()

                def logged() -> list[str]:
                    return [r["run_id"] for n in nodes for r in n.runs() if "outcome" in r]

                await poll(lambda: len(logged()) >= 1)
                assert logged() == [info.run_id for info, _ in edge.outcomes]
                assert recorder.bodies == []
                assert edge.counted("iop_edge_run_refusals_total") == 1
                assert edge.counted("iop_edge_retries_total") == 0
                assert edge.counted("iop_edge_node_errors_total") == 0
                ready = await http.get("/readyz")
                assert ready.status_code == 200, ready.text
                states = [(n["state"], n["failed_runs_in_a_row"]) for n in ready.json()["nodes"]]
                assert states == [("up", 0)] * 2
        finally:
            await stop_edge(edge)
