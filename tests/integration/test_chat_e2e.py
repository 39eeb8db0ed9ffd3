"""End to end: the official openai SDK and raw HTTP, through a real edge, to a real node.

Every test here goes over a hypercorn socket on 127.0.0.1 and over gRPC to
an `iop-sim-node` process.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from tests.integration.conftest import RunningEdge, SimProcess, chat_body, script


def _sdk(edge: RunningEdge) -> openai.OpenAI:
    return openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def parse_sse(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing byte by byte."""
    text = raw.decode()
    assert text.endswith("\n\n"), "every SSE frame ends with a blank line"
    payloads = []
    for frame in text.split("\n\n")[:-1]:
        if frame.startswith(":"):
            continue  # a comment (keep-alive)
        assert frame.startswith("data: "), f"unexpected frame {frame!r}"
        assert "\n" not in frame, "one data line per frame"
        payloads.append(frame[len("data: ") :])
    return payloads


async def test_sdk_streaming_echo(edge: RunningEdge, sim: SimProcess) -> None:
    """The SDK's streaming iterator gets the role, the echoed words, and finish_reason stop."""

    def call() -> list[Any]:
        with _sdk(edge) as client:
            return list(
                client.chat.completions.create(
                    model="sim-echo",
                    messages=[{"role": "user", "content": "hello big world"}],
                    stream=True,
                )
            )

    chunks = await trio.to_thread.run_sync(call)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "hello big world"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].id.startswith("chatcmpl-")
    run = await sim.wait_run(chunks[0].id.removeprefix("chatcmpl-"))
    assert run["outcome"] == "complete"
    assert not run["cancel_rpc"]


async def test_sdk_non_streaming_with_usage(edge: RunningEdge) -> None:
    """A non-streaming answer aggregates content, finish_reason and usage."""

    def call() -> Any:
        with _sdk(edge) as client:
            return client.chat.completions.create(
                model="sim-echo", messages=[{"role": "user", "content": "one two three"}]
            )

    completion = await trio.to_thread.run_sync(call)
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.content == "one two three"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens == 3
    assert completion.usage.completion_tokens == 3
    assert completion.usage.total_tokens == 6


async def test_sim_echo_counts_text_sent_as_parts(edge: RunningEdge) -> None:
    """sim-echo counts a prompt's words the same whether its text is a string or content
    parts (smolagents' chat parts, the Responses API's `input_text` as DSPy's and
    Haystack's Responses clients send it, Messages' text blocks), through the SDKs."""
    words = "what is the weather in Paris"
    parts = [{"type": "text", "text": "what is the weather"}, {"type": "text", "text": "in Paris"}]

    def chat(client: openai.OpenAI, content: Any) -> int:
        messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                    {"role": "user", "content": content}]  # fmt: skip
        answer = client.chat.completions.create(model="sim-echo", messages=messages)
        return answer.usage.prompt_tokens

    def responses(client: openai.OpenAI, content: Any) -> int:
        if not isinstance(content, str):
            content = [{"type": "input_text", "text": p["text"]} for p in content]
        item = {"role": "user", "content": content}
        answer = client.responses.create(model="sim-echo", input=[item], store=False)
        return answer.usage.input_tokens

    def call() -> list[tuple[int, int]]:
        with _sdk(edge) as client:
            return [(ask(client, words), ask(client, parts)) for ask in (chat, responses)]

    (chat_counts, responses_counts) = await trio.to_thread.run_sync(call)
    assert chat_counts == (8, 8)  # "Be brief." and the question's six words
    assert responses_counts == (6, 6)

    def messages() -> tuple[int, int]:
        with anthropic.Anthropic(base_url=edge.url, api_key="x", max_retries=0) as client:
            counts = []
            for content in (words, parts):
                answer = client.messages.create(
                    model="sim-echo", max_tokens=16, messages=[{"role": "user", "content": content}]
                )
                counts.append(answer.usage.input_tokens)
        return counts[0], counts[1]

    assert await trio.to_thread.run_sync(messages) == (6, 6)


async def test_async_sdk_streaming_include_usage(edge: RunningEdge) -> None:
    """The async SDK (on its own asyncio loop) sees one usage chunk with no choices, last."""

    def call() -> list[Any]:
        import asyncio

        async def go() -> list[Any]:
            async with openai.AsyncOpenAI(
                base_url=edge.url + "/v1", api_key="x", max_retries=0
            ) as client:
                stream = await client.chat.completions.create(
                    model="sim-script",
                    messages=[
                        {
                            "role": "user",
                            "content": script(
                                {"type": "delta", "delta": "hi"},
                                {
                                    "type": "complete",
                                    "usage": {
                                        "input_tokens": 5,
                                        "output_tokens": 1,
                                        "reasoning_tokens": 0,
                                        "cached_input_tokens": 2,
                                    },
                                },
                            ),
                        }
                    ],
                    stream=True,
                    stream_options={"include_usage": True},
                )
                return [chunk async for chunk in stream]

        return asyncio.run(go())

    chunks = await trio.to_thread.run_sync(call)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == 5
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2
    assert all(c.usage is None for c in chunks[:-1])


async def test_raw_sse_framing(http: httpx.AsyncClient) -> None:
    """The exact bytes: role chunk, content chunks, finish chunk, one [DONE], nothing after."""
    body = chat_body("sim-echo", "a b", stream=True)
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    payloads = parse_sse(raw)
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == ["a", " b"]
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["id"] == chunks[0]["id"]
        assert chunk["model"] == "sim-echo"
        assert isinstance(chunk["created"], int)


async def test_node_error_event_is_an_sse_error_frame(
    http: httpx.AsyncClient, edge: RunningEdge
) -> None:
    """A node `error` event ends the stream with one OpenAI-shaped error frame, no [DONE]."""
    body = chat_body(
        "sim-script",
        script({"type": "delta", "delta": "x"}, {"type": "error", "error": "GPU on fire"}),
        stream=True,
    )
    response = await http.post("/v1/chat/completions", json=body)
    payloads = parse_sse(response.content)
    assert "[DONE]" not in payloads
    last = json.loads(payloads[-1])
    assert last == {
        "error": {"message": "GPU on fire", "type": "run_error", "param": None, "code": None}
    }


async def test_sdk_raises_on_error_frame(edge: RunningEdge) -> None:
    """The SDK surfaces an error frame as an APIError with the node's message."""

    def call() -> None:
        with _sdk(edge) as client:
            stream = client.chat.completions.create(
                model="sim-script",
                stream=True,
                messages=[{"role": "user", "content": script({"type": "cancelled"})}],
            )
            for _ in stream:
                pass

    with pytest.raises(openai.APIError, match="run failed"):
        await trio.to_thread.run_sync(call)


async def test_broken_node_stream_is_an_error_frame(
    http: httpx.AsyncClient, sim: SimProcess
) -> None:
    """A node stream that breaks mid-run (abort) ends in an error frame, and CancelRun is sent."""
    body = chat_body(
        "sim-script", script({"type": "delta", "delta": "x"}, {"type": "abort"}), stream=True
    )
    response = await http.post("/v1/chat/completions", json=body)
    payloads = parse_sse(response.content)
    first = json.loads(payloads[0])
    error = json.loads(payloads[-1])["error"]
    assert error["type"] == "run_error"
    assert "ABORTED" in error["message"]
    run = await sim.wait_run(first["id"].removeprefix("chatcmpl-"))
    assert run["outcome"] == "aborted"


async def test_models_lists_the_nodes_models(http: httpx.AsyncClient) -> None:
    """GET /v1/models lists what the nodes serve, in OpenAI's list shape."""
    response = await http.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert {m["id"] for m in body["data"]} >= {"sim-echo", "sim-script"}


async def test_health(http: httpx.AsyncClient) -> None:
    """/healthz (and /health, the path of vLLM's server and of the gateways in front of
    it) answers while the process serves; /readyz while a node answers."""
    assert (await http.get("/healthz")).json() == {"status": "ok"}
    assert (await http.get("/health")).json() == {"status": "ok"}
    ready = await http.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
