"""End to end: `iop-node` continues an answer another node started, through a mock upstream.

The upstream is a small HTTP server on 127.0.0.1 that knows one answer, ANSWER. It
checks the request it gets: a request that ends with a partial assistant message
(with vLLM's `continue_final_message`, or as llama.cpp's prefill when it is told it
is one) is answered with the rest of ANSWER after that message's text, and counts
only that as its completion tokens; a request that continues something else gets a
400. Runs go over real gRPC to iop-node, in-process (`openai+http://`'s node) or a
process (`iop-node --continuation ...`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
from grpclib.client import Channel

from edge.contract._proto.iop.node import v1 as pb
from edge.node.bridge import asyncio_loop, call_asyncio
from edge.node.client import GrpcNodeClient, NodeSocket
from edge.nodes.embedded import embedded_upstream_node
from edge.nodes.upstream.continuation import PROBE_TEXT
from edge.nodes.upstream.server import UpstreamNode
from edge.stream.events import Complete, Delta, Failed, NodeEvent
from tests.integration.conftest import node_events, poll, start_upstream_node, stop_process
from tests.integration.rawhttp import read_request, send_events, send_whole, serve_upstream

WAIT_S = 10.0
ANSWER = "The capital of France is Paris, a city on the Seine."
PROMPT_TOKENS = 12


@dataclass
class ContinuingUpstream:
    """An OpenAI-compatible server of one model, `qwen`, listed as `owned_by` `owner`."""

    owner: str
    # How it tells a continuation: "vllm" (`continue_final_message`) or "llamacpp"
    # (a final assistant message is a prefill).
    dialect: str = "vllm"
    # llama.cpp: whether it streams the prefilled text back before the rest, unless the
    # request says `continue_final_message` ("unless"), or whatever it says ("always").
    echoes: str = "unless"
    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)

    def answer(self, body: dict[str, Any]) -> tuple[int, str]:
        """(status, text) for a chat request: the rest of ANSWER after what it continues
        (llama.cpp: the rest of any made-up answer is "x")."""
        last = body["messages"][-1]
        named = body.get("continue_final_message") is True
        continues = last["role"] == "assistant" and (self.dialect == "llamacpp" or named)
        if not continues:
            return 200, ANSWER
        if body.get("add_generation_prompt") is not False and (self.dialect == "vllm" or named):
            return 400, "continue_final_message needs add_generation_prompt false"
        held = last["content"]
        if self.dialect == "vllm" and not ANSWER.startswith(held):
            return 400, "the final message is not this answer's start"
        rest = ANSWER[len(held) :] if ANSWER.startswith(held) else "x"
        if self.dialect == "llamacpp" and (self.echoes == "always" or not named):
            return 200, held + rest
        return 200, rest

    async def serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                while (received := await read_request(stream, conn)) is not None:
                    request, raw = received
                    await self._respond(stream, conn, request.target, raw)
                    conn.start_next_cycle()
            except (trio.BrokenResourceError, h11.ProtocolError):
                return

    async def _respond(
        self, stream: trio.SocketStream, conn: h11.Connection, target: bytes, raw: bytes
    ) -> None:
        if target != b"/v1/chat/completions":
            status, kind = (200, "application/json") if target == b"/v1/models" else (404, "text")
            models = {"object": "list", "data": [{"id": "qwen", "owned_by": self.owner}]}
            body = json.dumps(models).encode() if status == 200 else b"Not Found"
            await send_whole(stream, conn, status, body, kind)
            return
        request = json.loads(raw)
        self.requests.append(request)
        status, text = self.answer(request)
        if status != 200:
            error = {"object": "error", "message": text, "code": 400}
            await send_whole(stream, conn, status, json.dumps(error).encode())
            return
        head = h11.Response(status_code=200, headers=[("content-type", "text/event-stream")])
        await send_events(stream, conn, head)
        pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
        for piece in pieces:
            await send_events(stream, conn, h11.Data(_sse({"delta": {"content": piece}})))
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(pieces)}
        finish = {"delta": {}, "finish_reason": "stop"}
        await send_events(stream, conn, h11.Data(_sse(finish, usage)))
        await send_events(stream, conn, h11.Data(b"data: [DONE]\n\n"), h11.EndOfMessage())


def _sse(choice: dict[str, Any], usage: dict[str, int] | None = None) -> bytes:
    chunk: dict[str, Any] = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, **choice}],
    }
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n".encode()


async def _serve(nursery: trio.Nursery, upstream: ContinuingUpstream) -> ContinuingUpstream:
    upstream.url = await serve_upstream(nursery, upstream.serve)
    return upstream


@pytest.fixture
async def vllm(nursery: trio.Nursery) -> ContinuingUpstream:
    return await _serve(nursery, ContinuingUpstream(owner="vllm"))


def _request(run_id: str, held: pb.Continuation | None = None) -> pb.RunRequest:
    return pb.RunRequest(
        run_id=run_id,
        model="qwen",
        messages=[pb.Message(role="user", content="Where is Paris?")],
        max_tokens=64,
        continuation=held,
    )


async def _run(where: NodeSocket, request: pb.RunRequest) -> list[NodeEvent]:
    client = GrpcNodeClient("node", where)
    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(WAIT_S):
                handle = await client.start_run(
                    nursery, request, deadline=trio.current_time() + WAIT_S
                )
                return await node_events(handle)
    finally:
        await client.aclose()


async def _describe(where: NodeSocket) -> pb.DescribeResponse:
    async def describe() -> pb.DescribeResponse:
        channel = Channel(where.host, where.port, path=where.path)
        try:
            return await pb.NodeServiceStub(channel).describe(pb.DescribeRequest())
        finally:
            channel.close()

    with trio.fail_after(WAIT_S):
        return await call_asyncio(describe)


def _text(events: list[NodeEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


async def test_vllm_upstream_continues_the_partial_answer(vllm: ContinuingUpstream) -> None:
    """iop-node before a vLLM server (auto: its model list says vllm) says `continuation`,
    and continues a run with the partial answer as the last message and vLLM's extra
    parameters: the node streams exactly the rest, and complete's usage counts the
    whole answer (the earlier runs' output tokens added to the upstream's)."""
    cut = 17
    held = pb.Continuation(text=ANSWER[:cut], output_tokens=4)
    async with asyncio_loop(), embedded_upstream_node("n", vllm.url) as (_, where):
        described = await _describe(where)
        uncut = await _run(where, _request("up-uncut"))
        rest = await _run(where, _request("up-rest", held))
    assert [(m.id, m.continuation) for m in described.models] == [("qwen", True)]
    assert _text(uncut) == ANSWER
    assert ANSWER[:cut] + _text(rest) == ANSWER
    sent = vllm.requests[-1]
    assert sent["messages"] == [
        {"role": "user", "content": "Where is Paris?"},
        {"role": "assistant", "content": ANSWER[:cut]},
    ]
    assert (sent["continue_final_message"], sent["add_generation_prompt"]) == (True, False)
    assert sent["max_tokens"] == 64 - 4
    assert "continue_final_message" not in vllm.requests[0]
    last = rest[-1]
    assert isinstance(last, Complete)
    assert last.usage is not None
    pieces = -(-(len(ANSWER) - cut) // 5)
    assert (last.usage.input_tokens, last.usage.output_tokens) == (PROMPT_TOKENS, pieces + 4)


async def test_a_continuation_the_upstream_refuses_is_a_node_failure(
    vllm: ContinuingUpstream,
) -> None:
    """A partial answer the upstream will not continue (its 400) ends the run with an
    error that is the node's failure (no status), not a refusal of the request."""
    held = pb.Continuation(text="Something else entirely")
    async with asyncio_loop(), embedded_upstream_node("n", vllm.url) as (_, where):
        await _describe(where)
        events = await _run(where, _request("up-refused", held))
    (event,) = events
    assert isinstance(event, Failed)
    assert event.http_status == 0
    assert event.error.startswith("upstream refused to continue the answer (400): ")


async def test_an_upstream_not_known_to_continue_says_no(nursery: trio.Nursery) -> None:
    """auto, before a server that is neither vLLM, SGLang nor llama.cpp (Ollama's owner):
    Describe says no `continuation`, and a run that continues anyway is an error event;
    the upstream is never asked."""
    upstream = await _serve(nursery, ContinuingUpstream(owner="library"))
    async with asyncio_loop(), embedded_upstream_node("n", upstream.url) as (_, where):
        described = await _describe(where)
        events = await _run(where, _request("up-no", pb.Continuation(text=ANSWER[:5])))
    assert [m.continuation for m in described.models] == [False]
    (event,) = events
    assert isinstance(event, Failed)
    assert "does not continue answers of model 'qwen'" in event.error
    assert upstream.requests == []


async def _described_after_probe(where: NodeSocket, node: UpstreamNode) -> pb.DescribeResponse:
    """Describe once the node's probe of its llama.cpp upstream has its answer."""
    await _describe(where)  # the first model list starts the probe
    await poll(lambda: node.continues is not None, within_s=WAIT_S)
    return await _describe(where)


async def test_auto_continues_on_llamacpp_once_the_probe_says_it_does(
    nursery: trio.Nursery,
) -> None:
    """auto, before llama.cpp (its owned_by): the node asks it once whether it continues
    (one token after a made-up answer, the `llamacpp` way); it does, so Describe says
    `continuation` and a run continues the answer there."""
    upstream = await _serve(nursery, ContinuingUpstream(owner="llamacpp", dialect="llamacpp"))
    async with asyncio_loop(), embedded_upstream_node("n", upstream.url) as (node, where):
        described = await _described_after_probe(where, node)
        rest = await _run(where, _request("up-probe", pb.Continuation(text=ANSWER[:30])))
    probe, sent = upstream.requests
    assert probe["messages"][-1]["content"] == PROBE_TEXT
    assert (probe["max_tokens"], probe["continue_final_message"]) == (1, True)
    assert [m.continuation for m in described.models] == [True]
    assert ANSWER[:30] + _text(rest) == ANSWER
    assert sent["continue_final_message"] is True


async def test_auto_does_not_continue_on_a_llamacpp_that_starts_over(
    nursery: trio.Nursery,
) -> None:
    """auto, before a llama.cpp server that streams the prefilled answer back whatever it
    is asked: the probe sees the answer start over, and Describe says no `continuation`
    (an answer moved there would reach the client twice)."""
    upstream = ContinuingUpstream(owner="llamacpp", dialect="llamacpp", echoes="always")
    await _serve(nursery, upstream)
    async with asyncio_loop(), embedded_upstream_node("n", upstream.url) as (node, where):
        described = await _described_after_probe(where, node)
    assert [m.continuation for m in described.models] == [False]
    assert len(upstream.requests) == 1


async def test_llamacpp_continuation_named_on_the_command_line(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """`iop-node --continuation llamacpp` (a process): Describe says `continuation`, and a
    run that continues sends the partial answer as the last message, which llama.cpp
    prefills, with `continue_final_message` (without it a current llama.cpp streams the
    prefill back first) and no reasoning: the node streams the rest. Named, the way is
    not probed."""
    upstream = await _serve(nursery, ContinuingUpstream(owner="llamacpp", dialect="llamacpp"))
    node = await trio.to_thread.run_sync(
        partial(
            start_upstream_node,
            tmp_path / "runs.jsonl",
            upstream.url,
            "--continuation",
            "llamacpp",
        )
    )
    try:
        where = NodeSocket.tcp("127.0.0.1", int(node.address.rsplit(":", 1)[1]))
        async with asyncio_loop():
            described = await _describe(where)
            held = pb.Continuation(text=ANSWER[:30], reasoning="Recall the capital.")
            rest = await _run(where, _request("up-llama", held))
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)
    assert [m.continuation for m in described.models] == [True]
    assert ANSWER[:30] + _text(rest) == ANSWER
    (sent,) = upstream.requests
    assert sent["messages"][-1] == {"role": "assistant", "content": ANSWER[:30]}
    assert (sent["continue_final_message"], sent["add_generation_prompt"]) == (True, False)
    assert isinstance(rest[-1], Complete)
