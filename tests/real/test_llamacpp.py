"""What the product claims for llama.cpp, checked against its real server.

`official SDK -> iop-edge -> iop-node (a process) -> llama-server`, every hop real, the
model tiny and greedy (temperature 0): the edge's answer is held to what the same
request gets from llama-server directly. docs/nodes.md's llama.cpp section lists what
this verifies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from edge.config import Config, NodeConfig, ServerConfig
from tests.integration.conftest import RunningEdge, SimProcess, poll, start_edge, stop_edge
from tests.real.llamacpp import MODEL_NAME, LlamaServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture
async def edge(nursery: trio.Nursery, iop_node: SimProcess) -> AsyncIterator[RunningEdge]:
    config = Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
        nodes=(NodeConfig("llama", iop_node.address),),
    )
    running = await start_edge(nursery, config)
    yield running
    await stop_edge(running)


def _chat(content: str = "Tell me about the sea.", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 24,
        **extra,
    }


async def _in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


async def _direct(llama: LlamaServer, body: dict[str, Any]) -> dict[str, Any]:
    """The same request, non-streamed, to llama-server itself."""
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(llama.url + "/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _openai(edge: RunningEdge) -> openai.OpenAI:
    return openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0)


def _anthropic(edge: RunningEdge) -> anthropic.Anthropic:
    """Used as a context manager: its pooled connection closed at the end, not when
    collected (an unclosed socket fails the test that happens to collect it)."""
    return anthropic.Anthropic(base_url=edge.url, api_key="unused", max_retries=0)


async def test_a_streamed_answer_is_the_servers(edge: RunningEdge, llama: LlamaServer) -> None:
    """Streamed through the edge: the server's text, its usage, one finish."""
    body = _chat()
    direct = await _direct(llama, body)

    def call() -> list[Any]:
        with _openai(edge) as client:
            return list(
                client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **body
                )
            )

    chunks = await _in_thread(call)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct["choices"][0]["message"]["content"]
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        direct["usage"]["prompt_tokens"],
        direct["usage"]["completion_tokens"],
    )


async def test_usage_and_cached_prompt_tokens(edge: RunningEdge, llama: LlamaServer) -> None:
    """Non-streamed: the server's counts; the same prompt again is served from its prompt
    cache, and the edge says how much (`prompt_tokens_details.cached_tokens`)."""
    body = _chat("A question about the cached prefix of a prompt, asked twice.")

    def call() -> Any:
        with _openai(edge) as client:
            return client.chat.completions.create(**body)

    first = await _in_thread(call)
    second = await _in_thread(call)
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.usage.completion_tokens == 24
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0


async def test_responses_answer_is_the_servers(edge: RunningEdge, llama: LlamaServer) -> None:
    """The Responses API over llama.cpp: the same text as its chat answer, with usage."""
    direct = await _direct(llama, _chat())

    def call() -> Any:
        with _openai(edge) as client:
            return client.responses.create(
                model=MODEL_NAME, input="Tell me about the sea.", temperature=0,
                max_output_tokens=24,
            )  # fmt: skip

    response = await _in_thread(call)
    assert response.output_text == direct["choices"][0]["message"]["content"]
    assert response.usage.output_tokens == 24


async def test_messages_answer_is_the_servers(edge: RunningEdge, llama: LlamaServer) -> None:
    """Anthropic's Messages API over llama.cpp, streamed with its SDK: the same text."""
    direct = await _direct(llama, _chat())

    def call() -> Any:
        with _anthropic(edge) as client, client.messages.stream(
            model=MODEL_NAME, max_tokens=24, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": "Tell me about the sea."}],
        ) as stream:  # fmt: skip
            return stream.get_final_message()

    message = await _in_thread(call)
    assert (
        "".join(b.text for b in message.content if b.type == "text")
        == (direct["choices"][0]["message"]["content"])
    )
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 24


async def test_stop_is_the_servers_and_messages_names_it(
    edge: RunningEdge, llama: LlamaServer
) -> None:
    """A stop string cuts the text where the server cuts it, and `/v1/messages` names the
    sequence that matched (`stop_sequence`), streamed or not, as llama-server's own
    Messages API does: llama.cpp says it in its own fields, asked for by iop-node."""
    whole = (await _direct(llama, _chat(max_tokens=40)))["choices"][0]["message"]["content"]
    words = whole.split()
    stop = next(w for w in words[3:] if whole.count(w) == 1 and len(w) > 2)
    cut = whole[: whole.index(stop)]
    own = await _direct(llama, _chat(max_tokens=40, stop=[stop, "never-there"]))
    assert own["choices"][0]["message"]["content"] == cut

    def chat() -> Any:
        with _openai(edge) as client:
            return client.chat.completions.create(**_chat(max_tokens=40, stop=[stop]))

    completion = await _in_thread(chat)
    assert completion.choices[0].message.content == cut
    assert completion.choices[0].finish_reason == "stop"

    def messages(stream: bool) -> Any:
        kwargs: dict[str, Any] = {
            "model": MODEL_NAME, "max_tokens": 40, "extra_body": {"temperature": 0},
            "stop_sequences": ["never-there", stop],
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
        }  # fmt: skip
        with _anthropic(edge) as client:
            if not stream:
                return client.messages.create(**kwargs)
            with client.messages.stream(**kwargs) as events:
                return events.get_final_message()

    for stream in (False, True):
        message = await _in_thread(lambda stream=stream: messages(stream))
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
        assert message.content[0].text == cut


async def test_context_overflow_is_a_refusal(edge: RunningEdge) -> None:
    """A prompt past the slot's context is llama.cpp's `exceed_context_size_error`: a 400
    `context_length_exceeded` for the client (the request's fault: no other node is
    tried, the node is not blamed)."""
    long = "sea " * 3000
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
        response = await client.post("/v1/chat/completions", json=_chat(long))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert edge.node("llama").health.breaker.failures == 0


async def test_load_is_read_and_an_unreported_kv_cache_is_unknown(
    edge: RunningEdge, llama: LlamaServer
) -> None:
    """iop-node reads llama-server's /metrics (`llamacpp:requests_processing`): a run in
    flight shows in the node's load; llama.cpp says nothing of its KV cache, and /readyz
    says `kv_cache_usage` null (not 0) and the gauge has no series for it."""
    async with (
        httpx.AsyncClient(base_url=edge.url, timeout=60) as client,
        trio.open_nursery() as nursery,
    ):
        body = _chat(max_tokens=1500)
        nursery.start_soon(lambda: client.post("/v1/chat/completions", json=body))

        def loaded() -> bool:
            state = edge.node("llama")
            return state.load is not None and state.load.active >= 1

        await poll(loaded)
        ready = (await client.get("/readyz")).json()
        metrics = (await client.get("/metrics")).text
        nursery.cancel_scope.cancel()
    (node,) = ready["nodes"]
    assert node["load"]["active_runs"] >= 1
    assert node["load"]["kv_cache_usage"] is None
    assert 'iop_edge_node_active_runs{node="llama"}' in metrics
    assert "iop_edge_node_kv_cache_usage{" not in metrics


async def test_logprobs_are_the_servers(edge: RunningEdge, llama: LlamaServer) -> None:
    """Token logprobs through the edge: one per token of the text, with alternatives."""
    body = _chat(max_tokens=8, logprobs=True, top_logprobs=2)

    def call() -> Any:
        with _openai(edge) as client:
            return client.chat.completions.create(**body)

    completion = await _in_thread(call)
    tokens = completion.choices[0].logprobs.content
    assert "".join(t.token for t in tokens) == completion.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 for t in tokens)


async def test_a_request_with_tools_is_the_servers(edge: RunningEdge, llama: LlamaServer) -> None:
    """Tools declared (and a tool result in the history) reach llama.cpp as it takes them:
    rendered by its Jinja chat template (Qwen2.5's `<tool_call>`), its answer the same as
    asked directly. (The tiny model writes no call: what it would write is llama.cpp's
    to parse, the edge takes native calls as typed calls, docs/nodes.md.)"""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]  # fmt: skip
    body = {**_chat(max_tokens=16), "messages": messages, "tools": [WEATHER]}
    direct = await _direct(llama, body)

    def call() -> Any:
        with _openai(edge) as client:
            return client.chat.completions.create(**body)

    completion = await _in_thread(call)
    assert completion.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert completion.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
