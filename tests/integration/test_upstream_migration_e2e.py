"""Migration through `iop-node`: an answer its upstream dropped mid-way goes on through
another `iop-node`, whose upstream continues it.

An `iop-edge` process in front of two `iop-node` processes ("a", listed first, and
"b"), each in front of its own mock vLLM-shaped upstream on 127.0.0.1:

- a's upstream streams the first pieces of ANSWER (a role chunk, then one chunk a
  piece) and then dies: it closes the connection in the middle of its chunked body
  (or ends the body and closes it), without a finish or `[DONE]`;
- b's upstream answers only the continuation of that answer: the partial answer as
  the last, assistant, message with `continue_final_message: true` and
  `add_generation_prompt: false` (what vLLM needs); it streams the rest of ANSWER,
  a finish (stop) with usage, and `[DONE]`. Any other request gets a 400, and every
  request is kept for the test to check.

The edge's first pick goes to the first node listed when they tie (both idle), so
the answer starts on a. For a stream, a's upstream cuts only once the client has
read the first pieces (an event, set by the reader): the break comes mid-answer,
after output was written. Waits are events, or bounded polls of another process's
state (the edge's /metrics, a node's runs log); nothing asserts a duration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import (
    SimProcess,
    chat_body,
    sse_content,
    sse_frames,
    start_upstream_node,
    stop_process,
)
from tests.integration.edgeproc import edge_process
from tests.integration.rawhttp import read_request, send_events, send_whole, serve_upstream

CHAT = "/v1/chat/completions"
WAIT_S = 20.0
ANSWER = "The capital of France is Paris, a city on the Seine, west of the Rhine."
PIECES = [ANSWER[i : i + 6] for i in range(0, len(ANSWER), 6)]
FIRST_PIECES = 4  # what a's upstream sends before it dies
FIRST = "".join(PIECES[:FIRST_PIECES])
PROMPT_TOKENS = 11
QUESTION = "Where is Paris?"


@dataclass
class MockUpstream:
    """A vLLM-shaped OpenAI-compatible server of one model, `qwen`.

    `dies`: it streams FIRST and then, once `cut` is set, closes the connection in
    the middle of the body ("closed") or ends the body, without `[DONE]` or a finish,
    and closes it ("ended"); "" (it lives): it answers only a continuation of FIRST,
    with the rest of ANSWER.
    """

    dies: str
    cut: trio.Event = field(default_factory=trio.Event)
    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)

    async def serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                while (received := await read_request(stream, conn)) is not None:
                    request, raw = received
                    if not await self._respond(stream, conn, request.target, raw):
                        return  # closed: the dying server's end
                    conn.start_next_cycle()
            except (trio.BrokenResourceError, h11.ProtocolError):
                return

    async def _respond(
        self, stream: trio.SocketStream, conn: h11.Connection, target: bytes, raw: bytes
    ) -> bool:
        """Answer one request; False when the connection must close."""
        if target == b"/v1/models":
            models = {"object": "list", "data": [{"id": "qwen", "owned_by": "vllm"}]}
            await send_whole(stream, conn, 200, json.dumps(models).encode())
            return True
        if target != b"/v1/chat/completions":  # /metrics: no load said
            await send_whole(stream, conn, 404, b'{"detail": "Not Found"}')
            return True
        body = json.loads(raw)
        self.requests.append(body)
        if not self.dies and not _continues_first(body):
            error = {"object": "error", "message": "not the continuation expected", "code": 400}
            await send_whole(stream, conn, 400, json.dumps(error).encode())
            return True
        head = h11.Response(status_code=200, headers=[("content-type", "text/event-stream")])
        await send_events(stream, conn, head, h11.Data(_sse({"role": "assistant", "content": ""})))
        pieces = PIECES[:FIRST_PIECES] if self.dies else PIECES[FIRST_PIECES:]
        for piece in pieces:
            await send_events(stream, conn, h11.Data(_sse({"content": piece})))
        if self.dies:
            with trio.fail_after(WAIT_S):
                await self.cut.wait()
            if self.dies == "ended":
                await send_events(stream, conn, h11.EndOfMessage())
            return False  # no [DONE]: the server died
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(pieces)}
        await send_events(stream, conn, h11.Data(_sse({}, "stop", usage)))
        await send_events(stream, conn, h11.Data(b"data: [DONE]\n\n"), h11.EndOfMessage())
        return True


def _continues_first(body: dict[str, Any]) -> bool:
    """Whether `body` continues FIRST the vLLM way, after the client's question."""
    return (
        body.get("messages")
        == [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": FIRST},
        ]
        and body.get("continue_final_message") is True
        and body.get("add_generation_prompt") is False
    )


def _sse(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> bytes:
    chunk: dict[str, Any] = {
        "id": "chatcmpl-upstream",
        "object": "chat.completion.chunk",
        "model": "qwen",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n".encode()


async def _serve(nursery: trio.Nursery, upstream: MockUpstream) -> MockUpstream:
    upstream.url = await serve_upstream(nursery, upstream.serve)
    return upstream


async def _iop_node(tmp: Path, name: str, upstream: MockUpstream, mode: str) -> SimProcess:
    return await trio.to_thread.run_sync(
        partial(
            start_upstream_node,
            tmp / f"{name}-runs.jsonl",
            upstream.url,
            "--name",
            name,
            "--continuation",
            mode,
        )
    )


def _edge_toml(a: SimProcess, b: SimProcess) -> str:
    return (
        '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'
        "[routing]\nmigrations = 1\n"
        f'[[nodes]]\nname = "a"\naddress = "{a.address}"\n'
        f'[[nodes]]\nname = "b"\naddress = "{b.address}"\n'
    )


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples named `name` in a /metrics page, by their labels."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def _migrations(text: str) -> dict[str, float]:
    """iop_edge_migrations_total by outcome (summed over reasons), non-zero ones."""
    out: dict[str, float] = {}
    for labels, value in _samples(text, "iop_edge_migrations_total").items():
        outcome = dict(labels)["outcome"]
        out[outcome] = out.get(outcome, 0.0) + value
    return {k: v for k, v in out.items() if v}


async def _read_stream(http: httpx.AsyncClient, body: dict[str, Any], cut: trio.Event) -> str:
    """The whole streamed answer; `cut` set once its text so far is FIRST."""
    text = ""
    async with http.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_text():
            text += chunk
            if (
                not cut.is_set()
                and sse_content(sse_frames(text[: text.rfind("\n\n") + 1])) == FIRST
            ):
                cut.set()
    return text


async def _ask(http: httpx.AsyncClient, stream: bool, cut: trio.Event) -> tuple[Any, str]:
    """QUESTION's answer, checked whole (exactly ANSWER, finish stop, one role chunk and
    one terminal for a stream, no error): its usage and run id."""
    body = chat_body("qwen", QUESTION, stream=stream)
    if not stream:
        answer = await http.post(CHAT, json=body)
        assert answer.status_code == 200, answer.text
        doc = answer.json()
        assert doc["choices"][0]["message"]["content"] == ANSWER
        assert doc["choices"][0]["finish_reason"] == "stop"
        return doc["usage"], doc["id"].removeprefix("chatcmpl-")
    body["stream_options"] = {"include_usage": True}
    text = await _read_stream(http, body, cut)
    assert text.endswith("data: [DONE]\n\n"), text[-400:]
    assert text.count("data: [DONE]") == 1
    frames = sse_frames(text)
    assert not any("error" in f for f in frames), text[-400:]
    assert sse_content(frames) == ANSWER
    choices = [f["choices"][0] for f in frames if f.get("choices")]
    assert len([c for c in choices if c["delta"].get("role")]) == 1
    assert [c["finish_reason"] for c in choices if c.get("finish_reason")] == ["stop"]
    (usage,) = [f["usage"] for f in frames if f.get("usage")]
    return usage, frames[0]["id"].removeprefix("chatcmpl-")


async def _both_up(http: httpx.AsyncClient) -> None:
    """Both nodes up (the edge asked each before it served; a slow first answer is
    asked again): the first pick is then a's, the first listed of two idle nodes."""
    up = {(("node", "a"),): 1.0, (("node", "b"),): 1.0}
    with trio.fail_after(WAIT_S):
        # Another process's state: poll, bounded.
        while _samples((await http.get("/metrics")).text, "iop_edge_node_state") != up:  # noqa: ASYNC110
            await trio.sleep(0.05)


@pytest.mark.parametrize(("stream", "dies"), [(True, "closed"), (False, "closed"), (True, "ended")])
async def test_an_answer_whose_upstream_died_is_continued_by_another_iop_node(
    nursery: trio.Nursery, tmp_path: Path, stream: bool, dies: str
) -> None:
    """a's upstream dies after the first pieces (its connection closed mid-body, or
    its body ended without `[DONE]`): the client (streaming or not) gets
    exactly ANSWER, finish stop, one terminal and usage (the whole answer's tokens),
    under one run id that both nodes ran; b's upstream was asked exactly the vLLM
    continuation of what a sent; the edge counts one migration."""
    a_up = await _serve(nursery, MockUpstream(dies=dies))
    b_up = await _serve(nursery, MockUpstream(dies=""))
    if not stream:
        a_up.cut.set()  # nothing to see from outside: it dies after its first pieces
    a = await _iop_node(tmp_path, "a", a_up, "vllm")
    try:
        b = await _iop_node(tmp_path, "b", b_up, "vllm")
        try:
            async with (
                edge_process(tmp_path, _edge_toml(a, b)) as edge,
                httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http,
            ):
                await _both_up(http)
                with trio.fail_after(WAIT_S):
                    usage, run_id = await _ask(http, stream, a_up.cut)
                assert usage["prompt_tokens"] == PROMPT_TOKENS
                # a's pieces as the edge counted them (a delta one token), b's as its
                # upstream did: the whole answer's.
                assert usage["completion_tokens"] == len(PIECES)
                migrations = _migrations((await http.get("/metrics")).text)
                assert migrations == {"migrated": 1.0}, migrations
            (first,) = a_up.requests
            assert first["messages"] == [{"role": "user", "content": QUESTION}]
            assert "continue_final_message" not in first
            (rest,) = b_up.requests
            assert _continues_first(rest), rest
            assert rest["stream"] is True
            assert (await a.wait_run(run_id))["outcome"] == "error"
            assert (await b.wait_run(run_id))["outcome"] == "complete"
        finally:
            await trio.to_thread.run_sync(stop_process, b.process)
    finally:
        await trio.to_thread.run_sync(stop_process, a.process)


async def test_a_node_that_does_not_continue_leaves_the_stream_cut(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """b's iop-node runs `--continuation none` (its model does not say `continuation`):
    the stream a's upstream dropped ends with an error frame after FIRST, no [DONE],
    as before migration; b's upstream is never asked; the edge counts the break as
    `no_node`, nothing migrated."""
    a_up = await _serve(nursery, MockUpstream(dies="closed"))
    b_up = await _serve(nursery, MockUpstream(dies=""))
    a = await _iop_node(tmp_path, "a", a_up, "vllm")
    try:
        b = await _iop_node(tmp_path, "b", b_up, "none")
        try:
            async with (
                edge_process(tmp_path, _edge_toml(a, b)) as edge,
                httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http,
            ):
                await _both_up(http)
                body = chat_body("qwen", QUESTION, stream=True)
                with trio.fail_after(WAIT_S):
                    text = await _read_stream(http, body, a_up.cut)
                assert "data: [DONE]" not in text, text[-400:]
                frames = sse_frames(text)
                assert sse_content(frames) == FIRST
                assert frames[-1]["error"]["type"] == "run_error", text[-400:]
                migrations = _migrations((await http.get("/metrics")).text)
                assert migrations == {"no_node": 1.0}, migrations
            assert len(a_up.requests) == 1
            assert b_up.requests == []
        finally:
            await trio.to_thread.run_sync(stop_process, b.process)
    finally:
        await trio.to_thread.run_sync(stop_process, a.process)
