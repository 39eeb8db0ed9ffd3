"""End to end: logprobs with the official openai SDK, through a real edge, to real nodes.

The simulated node (a process) gives logprobs; `iop-node` (a process) in front
of an edge passes them on, or says in its Describe that it cannot
(`--no-logprobs`), and then the edge answers 400 before any run starts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from edge.config import Config, NodeConfig, ServerConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    script,
    start_edge,
    start_upstream_node,
    stop_edge,
    stop_process,
)


def _sdk(edge: RunningEdge) -> openai.OpenAI:
    return openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def _in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


def _streamed(edge: RunningEdge, **kwargs: Any) -> list[Any]:
    with _sdk(edge) as client:
        return list(client.chat.completions.create(stream=True, **kwargs))


async def test_sdk_streaming_logprobs(edge: RunningEdge) -> None:
    """Each content chunk carries `choices[0].logprobs.content` for its own tokens, with
    bytes and as many top_logprobs as asked; the role and finish chunks carry null."""
    chunks = await _in_thread(
        lambda: _streamed(
            edge,
            model="sim-echo",
            messages=[{"role": "user", "content": "hello big world"}],
            logprobs=True,
            top_logprobs=2,
        )
    )
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert [c.choices[0].delta.content for c in content] == ["hello", " big", " world"]
    for chunk in content:
        (token,) = chunk.choices[0].logprobs.content
        assert token.token == chunk.choices[0].delta.content
        assert token.logprob == pytest.approx(-0.1)
        assert token.bytes == list(token.token.encode())
        assert [t.token for t in token.top_logprobs] == [token.token, token.token + "~1"]
        assert chunk.choices[0].logprobs.refusal is None
    assert chunks[0].choices[0].logprobs is None
    assert chunks[-1].choices[0].logprobs is None
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_sdk_non_streaming_logprobs(edge: RunningEdge) -> None:
    """The non-streaming answer's `choices[0].logprobs.content` holds every content token."""

    def call() -> Any:
        with _sdk(edge) as client:
            return client.chat.completions.create(
                model="sim-echo",
                messages=[{"role": "user", "content": "one two"}],
                logprobs=True,
            )

    completion = await _in_thread(call)
    choice = completion.choices[0]
    assert choice.message.content == "one two"
    assert [t.token for t in choice.logprobs.content] == ["one", " two"]
    assert all(t.top_logprobs == [] for t in choice.logprobs.content)


async def test_without_logprobs_the_answer_says_null(http: httpx.AsyncClient) -> None:
    """A request that did not ask gets `"logprobs": null`, streaming or not."""
    response = await http.post("/v1/chat/completions", json=chat_body("sim-echo", "hi there"))
    assert response.json()["choices"][0]["logprobs"] is None
    response = await http.post(
        "/v1/chat/completions", json=chat_body("sim-echo", "hi there", stream=True)
    )
    assert '"logprobs":null' in response.text
    assert '"logprobs":{' not in response.text


async def test_script_logprobs_and_a_removed_special_token(edge: RunningEdge) -> None:
    """A script's delta logprobs reach the client as written; the logprob of a leaked
    special token the edge removes is dropped with it; think-block tokens too."""
    events = script(
        {
            "type": "delta",
            "delta": "Hi",
            "logprobs": [
                {
                    "token": "Hi",
                    "logprob": -0.5,
                    "bytes": [72, 105],
                    "top_logprobs": [
                        {"token": "Hi", "logprob": -0.5},
                        {"token": "Yo", "logprob": -3},
                    ],
                }
            ],
        },
        {
            "type": "delta",
            "delta": "!<|im_end|>",
            "logprobs": [{"token": "!", "logprob": -1}, {"token": "<|im_end|>", "logprob": -2}],
        },
        {"type": "complete", "metadata": {"finish_reason": "stop"}},
    )

    def call() -> Any:
        with _sdk(edge) as client:
            return client.chat.completions.create(
                model="sim-script", messages=[{"role": "user", "content": events}], logprobs=True
            )

    completion = await _in_thread(call)
    choice = completion.choices[0]
    assert choice.message.content == "Hi!"
    assert [(t.token, t.logprob) for t in choice.logprobs.content] == [("Hi", -0.5), ("!", -1.0)]
    first = choice.logprobs.content[0]
    assert first.bytes == [72, 105]
    assert [(t.token, t.logprob, t.bytes) for t in first.top_logprobs] == [
        ("Hi", -0.5, [72, 105]),
        ("Yo", -3.0, [89, 111]),
    ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"top_logprobs": 2}, "logprobs")],
)
async def test_bad_logprobs_fields_are_400(
    http: httpx.AsyncClient, extra: dict[str, Any], param: str
) -> None:
    """top_logprobs past 20, or without logprobs: true, is a 400 naming the field."""
    response = await http.post("/v1/chat/completions", json=chat_body("sim-echo", "x", **extra))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


# --- a node that cannot: iop-node --no-logprobs, in front of the edge ----------------


@pytest.fixture
async def blind_edge(
    nursery: trio.Nursery, edge: RunningEdge, tmp_path: Path
) -> AsyncIterator[tuple[RunningEdge, SimProcess]]:
    """An edge whose one node is an iop-node that says it gives no logprobs."""
    node = await trio.to_thread.run_sync(
        lambda: start_upstream_node(
            tmp_path / "iop-node-runs.jsonl", edge.url + "/v1", "--no-logprobs"
        )
    )
    try:
        config = Config(
            server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
            nodes=(NodeConfig("blind", node.address),),
        )
        running = await start_edge(nursery, config)
        yield running, node
        await stop_edge(running)
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)


async def test_node_that_cannot_gives_400_before_any_run(
    blind_edge: tuple[RunningEdge, SimProcess],
) -> None:
    """A request with logprobs for a model whose node's Describe says it cannot give them
    is a 400 invalid_request_error with param "logprobs", streaming or not, and no run
    reaches the node; without logprobs the same model answers."""
    running, node = blind_edge

    def call(**kwargs: Any) -> Any:
        with _sdk(running) as client:
            return client.chat.completions.create(
                model="sim-echo", messages=[{"role": "user", "content": "hi"}], **kwargs
            )

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            await _in_thread(lambda s=stream: call(logprobs=True, stream=s))  # type: ignore[misc]
        error = caught.value.body
        assert isinstance(error, dict)
        assert (error["type"], error["param"]) == ("invalid_request_error", "logprobs")
    assert node.runs() == []
    completion = await _in_thread(lambda: call())
    assert completion.choices[0].message.content == "hi"
    assert completion.choices[0].logprobs is None


async def test_iop_node_passes_logprobs_through(
    nursery: trio.Nursery, edge: RunningEdge, tmp_path: Path
) -> None:
    """SDK -> edge B -> iop-node -> edge A -> sim: the sim's logprobs, rendered by edge A
    in OpenAI's shape, are mapped by iop-node into the contract and rendered again by B."""
    node = await trio.to_thread.run_sync(
        lambda: start_upstream_node(tmp_path / "runs.jsonl", edge.url + "/v1")
    )
    try:
        config = Config(
            server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
            nodes=(NodeConfig("iop-node", node.address),),
        )
        b = await start_edge(nursery, config)
        chunks = await _in_thread(
            lambda: _streamed(
                b,
                model="sim-echo",
                messages=[{"role": "user", "content": "alpha beta"}],
                logprobs=True,
                top_logprobs=3,
            )
        )
        tokens = [
            t
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content
        ]
        assert [t.token for t in tokens] == ["alpha", " beta"]
        assert [len(t.top_logprobs) for t in tokens] == [3, 3]
        assert tokens[1].top_logprobs[2].token == " beta~2"
        await stop_edge(b)
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)
