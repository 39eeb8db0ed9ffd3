"""End to end: the endpoints beside the three chat APIs, through a real edge to node
processes: `POST /v1/messages/count_tokens` and `GET /v1/models/{id}` with the official
Anthropic SDK and raw HTTP, `POST /v1/completions` (legacy completions) in both
renderings, and the Anthropic-shaped errors of every `/v1/messages*` path.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import trio

from edge.config import Config, KeyConfig, NodeConfig, ServerConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    edge_config,
    script,
    sse_frames,
    start_edge,
    start_sim,
    start_upstream_node,
    stop_edge,
    stop_process,
)

COMPLETIONS = "/v1/completions"
COUNT = "/v1/messages/count_tokens"
# An id with a "/", as model servers name models (org/name).
SLASHED = "meta-llama/Llama-3-8B"
KEYS = (KeyConfig("echo-only", "sk-echo", models=("sim-echo",)),)


def _sdk(url: str, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=30)


async def _anthropic(url: str, call: Callable[[anthropic.Anthropic], Any], key: str = "x") -> Any:
    def run() -> Any:
        with _sdk(url, key) as client:
            return call(client)

    return await trio.to_thread.run_sync(run)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


@pytest.fixture
async def http(edge: RunningEdge) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        yield client


@pytest.fixture
async def keyed(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[RunningEdge]:
    base = edge_config(sim)
    config = Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
        timeouts=base.timeouts,
        nodes=base.nodes,
        keys=KEYS,
    )
    running = await start_edge(nursery, config)
    yield running
    await stop_edge(running)


# --- count_tokens -------------------------------------------------------------


async def test_count_tokens_is_the_cache_models_input_tokens(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """`messages.count_tokens` (the SDK's call) answers the prompt's characters per
    CHARS_PER_TOKEN: the input tokens a simulated node with its cache model reports for
    the same request on /v1/messages (system prompt, tools and messages all counted)."""
    node = await trio.to_thread.run_sync(
        lambda: start_sim(tmp_path, "kv", "--kv-tokens", "65536", "--prefill-us-per-token", "0")
    )
    try:
        running = await start_edge(nursery, edge_config(node))
        tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
        prompt = {
            "model": "sim-echo", "system": "You are terse.", "tools": tools,
            "messages": _user("What is the weather like in Paris today, in a few words?"),
        }  # fmt: skip
        counted = await _anthropic(running.url, lambda c: c.messages.count_tokens(**prompt))
        message = await _anthropic(
            running.url, lambda c: c.messages.create(max_tokens=50, **prompt)
        )
        usage = message.usage
        reported = usage.input_tokens + (usage.cache_read_input_tokens or 0)
        assert counted.input_tokens == reported > 10
        shorter = await _anthropic(
            running.url, lambda c: c.messages.count_tokens(model="sim-echo", messages=_user("hi"))
        )
        assert 1 <= shorter.input_tokens < counted.input_tokens
        await stop_edge(running)
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)


async def test_count_tokens_refusals_are_anthropic_shaped(
    edge: RunningEdge, http: httpx.AsyncClient
) -> None:
    """A body /v1/messages would refuse is the same 400; an unknown model is the SDK's
    NotFoundError; nothing is counted against a node (no run starts)."""
    bad = await http.post(COUNT, json={"model": "sim-echo", "messages": "hi"})
    assert bad.status_code == 400
    assert bad.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "messages: Input should be an array"},
    }
    not_json = await http.post(COUNT, content=b"{")
    assert not_json.status_code == 400
    assert not_json.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        await _anthropic(
            edge.url, lambda c: c.messages.count_tokens(model="nope", messages=_user("x"))
        )
    assert edge.outcomes == []


async def test_count_tokens_and_models_follow_the_keys_allow_list(keyed: RunningEdge) -> None:
    """With keys: no key is Anthropic's 401; a model outside the key's allow-list is
    404 to count_tokens and models.retrieve alike, as if it did not exist."""
    with pytest.raises(anthropic.AuthenticationError) as denied:
        await _anthropic(
            keyed.url, lambda c: c.messages.count_tokens(model="sim-echo", messages=_user("x"))
        )
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    counted = await _anthropic(
        keyed.url,
        lambda c: c.messages.count_tokens(model="sim-echo", messages=_user("x")),
        key="sk-echo",
    )
    assert counted.input_tokens >= 1
    for call in (
        lambda c: c.messages.count_tokens(model="sim-script", messages=_user("x")),
        lambda c: c.models.retrieve("sim-script"),
    ):
        with pytest.raises(anthropic.NotFoundError):
            await _anthropic(keyed.url, call, key="sk-echo")
    listed = await _anthropic(keyed.url, lambda c: [m.id for m in c.models.list()], key="sk-echo")
    assert listed == ["sim-echo"]


# --- models ---------------------------------------------------------------------


async def test_model_in_each_apis_shape(edge: RunningEdge, http: httpx.AsyncClient) -> None:
    """`/v1/models/{id}`: OpenAI's model object, or Anthropic's when the request looks
    like an Anthropic client's; the list likewise; an unknown id is 404 in each shape."""
    openai_model = await http.get("/v1/models/sim-echo")
    assert openai_model.json() == {
        "id": "sim-echo", "object": "model", "created": 0, "owned_by": "iop",
    }  # fmt: skip
    info = await _anthropic(edge.url, lambda c: c.models.retrieve("sim-echo"))
    assert (info.type, info.id, info.display_name) == ("model", "sim-echo", "sim-echo")
    page = (await http.get("/v1/models", headers={"anthropic-version": "2023-06-01"})).json()
    assert [m["id"] for m in page["data"]] == ["sim-echo", "sim-script"]
    assert (page["has_more"], page["first_id"], page["last_id"]) == (
        False, "sim-echo", "sim-script",
    )  # fmt: skip
    missing = await http.get("/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as not_found:
        await _anthropic(edge.url, lambda c: c.models.retrieve("nope"))
    assert not_found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


async def test_model_ids_with_a_slash(
    nursery: trio.Nursery, edge: RunningEdge, tmp_path: Path
) -> None:
    """An id holding "/" (an iop-node in front of an edge, serving it under that name)
    is found sent as written or escaped (`%2F`, the SDKs' way); the route's own part
    must still be as written."""
    node = await trio.to_thread.run_sync(
        lambda: start_upstream_node(tmp_path / "runs.jsonl", edge.url + "/v1", "--models", SLASHED)
    )
    try:
        config = Config(
            server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
            nodes=(NodeConfig("iop-node", node.address),),
        )
        running = await start_edge(nursery, config)
        info = await _anthropic(running.url, lambda c: c.models.retrieve(SLASHED))
        assert info.id == SLASHED
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            for path in (f"/v1/models/{SLASHED}", "/v1/models/meta-llama%2FLlama-3-8B"):
                response = await http.get(path)
                assert response.json()["id"] == SLASHED, path
            escaped_route = await http.get("/v1/model%73/meta-llama/Llama-3-8B")
            assert escaped_route.status_code == 404
            assert escaped_route.json()["error"]["code"] == "not_found"
        await stop_edge(running)
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)


# --- errors under /v1/messages ------------------------------------------------------


async def test_messages_paths_answer_errors_in_anthropics_shape(
    http: httpx.AsyncClient, keyed: RunningEdge
) -> None:
    """An unknown path under /v1/messages, a wrong method, and a missing key are all
    `{"type": "error", "error": {...}}` with Anthropic's error types."""
    expected = {
        ("POST", "/v1/messages/unknown"): (404, "not_found_error"),
        ("GET", "/v1/messages"): (405, "invalid_request_error"),
        ("GET", COUNT): (405, "invalid_request_error"),
    }
    for (method, path), (status, kind) in expected.items():
        response = await http.request(method, path)
        assert response.status_code == status, path
        assert response.json()["type"] == "error", path
        assert response.json()["error"]["type"] == kind, path
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30) as keyless:
        denied = await keyless.post(COUNT, json={})
    assert denied.status_code == 401
    assert denied.json()["error"]["type"] == "authentication_error"
    chat_404 = await http.post("/v1/chat/unknown")
    assert chat_404.json()["error"]["code"] == "not_found"  # OpenAI's, elsewhere


# --- legacy completions -----------------------------------------------------------


async def test_completion_non_stream_with_echo(http: httpx.AsyncClient) -> None:
    """A `text_completion`: the prompt (echoed) then the answer as `choices[0].text`,
    finish_reason and usage; a list of one prompt is that prompt."""
    response = await http.post(
        COMPLETIONS, json={"model": "sim-echo", "prompt": ["hello there"], "echo": True}
    )
    body = response.json()
    assert response.status_code == 200
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["choices"] == [
        {"text": "hello therehello there", "index": 0, "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"]["completion_tokens"] == 2


async def test_completion_is_one_user_message_with_16_tokens(http: httpx.AsyncClient) -> None:
    """The node is given the prompt as one user message, max_tokens 16 when absent (the
    API's default), reasoning not asked for, and the fields chat shares (stop, seed)."""
    prompt = script({"type": "request"}, {"type": "complete"})
    response = await http.post(
        COMPLETIONS, json={"model": "sim-script", "prompt": prompt, "stop": ["\n\n"], "seed": 7}
    )
    sent = json.loads(response.json()["choices"][0]["text"])
    assert sent["messages"] == [{"role": "user", "content": prompt}]
    assert (sent["maxTokens"], sent["stop"], sent["seed"]) == (16, ["\n\n"], "7")
    assert not sent.get("includeReasoning")


async def test_completion_stream_with_logprobs_and_usage(http: httpx.AsyncClient) -> None:
    """SSE `text_completion` chunks: each text piece with its legacy logprobs (tokens,
    token_logprobs, top_logprobs, text_offset), then the finish chunk, the usage chunk
    (include_usage) and `data: [DONE]`."""
    body = {
        "model": "sim-echo", "prompt": "one two", "stream": True, "logprobs": 1,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    async with http.stream("POST", COMPLETIONS, json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = (await response.aread()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    frames = sse_frames(raw)
    assert {f["object"] for f in frames} == {"text_completion"}
    pieces = [f["choices"][0] for f in frames if f["choices"]]
    assert "".join(p["text"] for p in pieces) == "one two"
    logprobs = [p["logprobs"] for p in pieces if p["logprobs"] is not None]
    assert [lp["tokens"] for lp in logprobs] == [["one"], [" two"]]
    assert [lp["text_offset"] for lp in logprobs] == [[0], [3]]
    assert all(len(lp["top_logprobs"][0]) >= 1 for lp in logprobs)
    assert pieces[-1]["finish_reason"] == "stop"
    assert frames[-1]["choices"] == []
    assert frames[-1]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"suffix": "end"}, "suffix"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"logprobs": True}, "logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
async def test_completion_refusals_name_the_field(
    http: httpx.AsyncClient, extra: dict[str, Any], param: str
) -> None:
    """What the edge cannot do is a 400 in OpenAI's shape naming the field, never a 500."""
    response = await http.post(COMPLETIONS, json={"model": "sim-echo", "prompt": "x", **extra})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
