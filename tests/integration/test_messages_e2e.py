"""End to end: `POST /v1/messages` with the official anthropic SDK, through a real edge,
to an `iop-sim-node` process.

The same run and session as chat completions, rendered as Anthropic's
Messages API; what is checked is what the SDK's parsers and stream
accumulator make of it, and the raw frames where the SDK hides them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import trio

from edge.config import ServerConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    edge_config,
    script,
    start_edge,
    start_sim,
    stop_edge,
    stop_process,
)
from tests.integration.test_admission_e2e import WAIT_S, _full

MESSAGES = "/v1/messages"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TOOL_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
THINKING = script(
    {"type": "reasoning_delta", "delta": "Let me "},
    {"type": "reasoning_delta", "delta": "think."},
    {"type": "delta", "delta": "Done."},
    {"type": "complete", "usage": {"input_tokens": 4, "output_tokens": 6}},
)


def _sdk(url: str, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=30)


async def _in_thread(edge: RunningEdge, call: Any, api_key: str = "unused") -> Any:
    def run() -> Any:
        with _sdk(edge.url, api_key) as client:
            return call(client)

    return await trio.to_thread.run_sync(run)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def test_create_non_stream(edge: RunningEdge, sim: SimProcess) -> None:
    """`messages.create`: one text block, stop_reason end_turn, usage, a msg_ id."""
    message = await _in_thread(
        edge,
        lambda c: c.messages.create(
            model="sim-echo", max_tokens=100, system="Be brief.", messages=_user("hello world")
        ),
    )
    assert message.type == "message"
    assert message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "hello world"
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens > 0
    run = await sim.wait_run(message.id.removeprefix("msg_"))
    assert run["outcome"] == "complete"


async def test_stream_final_message(edge: RunningEdge) -> None:
    """`messages.stream(...)`: text deltas, and `get_final_message()` assembled by the SDK."""

    def call(client: anthropic.Anthropic) -> tuple[str, Any]:
        with client.messages.stream(
            model="sim-echo", max_tokens=100, messages=_user("one two three")
        ) as stream:
            text = "".join(stream.text_stream)
            return text, stream.get_final_message()

    text, final = await _in_thread(edge, call)
    assert text == "one two three"
    assert final.content[0].text == "one two three"
    assert final.stop_reason == "end_turn"


async def test_raw_stream_event_order(http: httpx.AsyncClient) -> None:
    """message_start, a content block's start/deltas/stop, message_delta, message_stop."""
    body = {"model": "sim-echo", "max_tokens": 50, "stream": True, "messages": _user("hi there")}
    async with http.stream("POST", MESSAGES + "?beta=true", json=body,
                           headers={"anthropic-version": "2023-06-01"}) as response:  # fmt: skip
        assert response.status_code == 200
        raw = (await response.aread()).decode()
    kinds = []
    for frame in (f for f in raw.split("\n\n") if f and not f.startswith(":")):
        event_line, data_line = frame.split("\n")
        kind = event_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == kind
        kinds.append(kind)
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


async def test_thinking_blocks(edge: RunningEdge) -> None:
    """With thinking enabled the reasoning is a thinking block before the text; without
    it, only the text."""

    def call(client: anthropic.Anthropic, thinking: dict[str, Any] | None) -> Any:
        extra: dict[str, Any] = {"thinking": thinking} if thinking else {}
        with client.messages.stream(
            model="sim-script", max_tokens=2048, messages=_user(THINKING), **extra
        ) as stream:
            return stream.get_final_message()

    final = await _in_thread(edge, lambda c: call(c, {"type": "enabled", "budget_tokens": 1024}))
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Let me think."
    assert final.content[1].text == "Done."
    assert (final.usage.input_tokens, final.usage.output_tokens) == (4, 6)
    hidden = await _in_thread(edge, lambda c: call(c, None))
    assert [b.type for b in hidden.content] == ["text"]
    assert hidden.content[0].text == "Done."
    whole = await _in_thread(
        edge,
        lambda c: c.messages.create(
            model="sim-script", max_tokens=2048, messages=_user(THINKING),
            thinking={"type": "enabled", "budget_tokens": 1024},
        ),
    )  # fmt: skip
    assert [b.type for b in whole.content] == ["thinking", "text"]


async def test_tool_loop(edge: RunningEdge) -> None:
    """A tool_use block (stop_reason tool_use), its tool_result sent back, then the answer."""
    turns = json.dumps({"turns": [
        {"events": [{"type": "delta", "delta": TOOL_CALL}, {"type": "complete"}]},
        {"events": [{"type": "delta", "delta": "It is sunny."}, {"type": "complete"}]},
    ]})  # fmt: skip

    def loop(client: anthropic.Anthropic) -> tuple[Any, Any]:
        with client.messages.stream(
            model="sim-script", max_tokens=100, tools=[WEATHER], messages=_user(turns)
        ) as stream:
            first = stream.get_final_message()
        uses = [b for b in first.content if b.type == "tool_use"]
        messages: list[Any] = [
            *_user(turns),
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": "sunny"} for u in uses
            ]},
        ]  # fmt: skip
        second = client.messages.create(
            model="sim-script", max_tokens=100, tools=[WEATHER], messages=messages
        )
        return first, second

    first, second = await _in_thread(edge, loop)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == "It is sunny."


async def test_max_tokens_stop_reason(edge: RunningEdge) -> None:
    body = script(
        {"type": "delta", "delta": "cut"},
        {"type": "complete", "metadata": {"finish_reason": "length"}},
    )
    message = await _in_thread(
        edge, lambda c: c.messages.create(model="sim-script", max_tokens=1, messages=_user(body))
    )
    assert message.stop_reason == "max_tokens"


async def test_stop_sequence_stop_reason(edge: RunningEdge) -> None:
    """A node that says its stop sequence matched: `stop_sequence` (chat says `stop`)."""
    body = script(
        {"type": "delta", "delta": "up to the"},
        {"type": "complete", "metadata": {"finish_reason": "stop_sequence"}},
    )

    def call(c: anthropic.Anthropic) -> tuple[Any, Any]:
        created = c.messages.create(model="sim-script", max_tokens=64, messages=_user(body))
        with c.messages.stream(model="sim-script", max_tokens=64, messages=_user(body)) as s:
            streamed = s.get_final_message()
        return created, streamed

    created, streamed = await _in_thread(edge, call)
    assert created.stop_reason == streamed.stop_reason == "stop_sequence"
    assert created.stop_sequence is None  # the request had none: which is unknown


async def test_stop_sequence_names_the_one_that_matched(edge: RunningEdge) -> None:
    """The request's stop sequence the node names (`stop_sequence` in its complete
    metadata) is the Message's `stop_sequence`, streamed (message_delta) and not."""
    body = script(
        {"type": "delta", "delta": "up to the"},
        {"type": "complete", "metadata": {"finish_reason": "stop", "stop_sequence": "STOP"}},
    )
    stops = ["END", "STOP"]

    def call(c: anthropic.Anthropic) -> tuple[Any, Any]:
        created = c.messages.create(
            model="sim-script", max_tokens=64, messages=_user(body), stop_sequences=stops
        )
        with c.messages.stream(
            model="sim-script", max_tokens=64, messages=_user(body), stop_sequences=stops
        ) as s:
            streamed = s.get_final_message()
        return created, streamed

    for message in await _in_thread(edge, call):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "STOP")


async def test_usage_as_the_sdk_counts_it(edge: RunningEdge) -> None:
    """Anthropic's accounting: `input_tokens` leave out the cached ones, so input + cache
    read + cache creation is the node's 11 prompt tokens (4 cached), in `message.usage`
    and in the stream's final message alike."""
    usage = {"input_tokens": 11, "output_tokens": 2, "cached_input_tokens": 4}
    body = script({"type": "delta", "delta": "ok"}, {"type": "complete", "usage": usage})

    def call(c: anthropic.Anthropic) -> tuple[Any, Any]:
        created = c.messages.create(model="sim-script", max_tokens=8, messages=_user(body))
        with c.messages.stream(model="sim-script", max_tokens=8, messages=_user(body)) as s:
            streamed = s.get_final_message()
        return created, streamed

    for message in await _in_thread(edge, call):
        u = message.usage
        assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (
            7, 4, 0,
        )  # fmt: skip
        assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == 11
        assert u.output_tokens == 2


async def test_tool_result_is_error_reaches_the_node(edge: RunningEdge) -> None:
    """A tool_result with `is_error: true` reaches the node as a tool message whose content
    says the call failed (`Error: ...`); one without it as sent."""
    request = script({"type": "request"}, {"type": "complete"})
    uses = [{"type": "tool_use", "id": f"t{i}", "name": "get_weather", "input": {"city": "X"}}
            for i in range(2)]  # fmt: skip
    messages: list[Any] = [
        *_user("Weather?"),
        {"role": "assistant", "content": uses},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t0", "content": "no such city",
             "is_error": True},
            {"type": "tool_result", "tool_use_id": "t1", "content": "22 C"},
        ]},
    ]  # fmt: skip
    message = await _in_thread(
        edge,
        lambda c: c.messages.create(model="sim-script", max_tokens=64, system=request,
                                    tools=[WEATHER], messages=messages),
    )  # fmt: skip
    sent = json.loads(message.content[0].text)
    tools = [(m["toolCallId"], m["content"]) for m in sent["messages"] if m["role"] == "tool"]
    assert tools == [("t0", "Error: no such city"), ("t1", "22 C")]


async def test_errors_are_sdk_exceptions(edge: RunningEdge, http: httpx.AsyncClient) -> None:
    """Refused requests in Anthropic's shape and statuses; a mid-stream error is an
    `event: error` the SDK raises."""
    response = await http.post(MESSAGES, json={"model": "sim-echo", "messages": _user("hi")})
    assert response.status_code == 400
    assert response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    with pytest.raises(anthropic.NotFoundError) as not_found:
        await _in_thread(
            edge,
            lambda c: c.messages.create(model="no-such-model", max_tokens=5, messages=_user("x")),
        )
    assert not_found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    failing = script({"type": "error", "error": "node said no"})
    with pytest.raises(anthropic.InternalServerError, match="node said no"):
        await _in_thread(
            edge,
            lambda c: c.messages.create(model="sim-script", max_tokens=5, messages=_user(failing)),
        )
    mid = script({"type": "delta", "delta": "partial"}, {"type": "error", "error": "broke"})

    def stream_it(client: anthropic.Anthropic) -> None:
        with client.messages.stream(
            model="sim-script", max_tokens=5, messages=_user(mid)
        ) as stream:
            stream.get_final_message()

    with pytest.raises(anthropic.APIStatusError, match="broke"):
        await _in_thread(edge, stream_it)
    unknown = await http.post("/v1/messages/nope", json={})
    assert unknown.status_code == 404


@pytest.fixture
async def keyed(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[RunningEdge]:
    config = edge_config(sim)
    config = type(config)(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0, api_keys=("sk-edge",)),
        timeouts=config.timeouts,
        nodes=config.nodes,
    )
    running = await start_edge(nursery, config)
    yield running
    await stop_edge(running)


async def test_x_api_key(keyed: RunningEdge) -> None:
    """The key as `x-api-key` (the SDK's way) is accepted; a wrong one is Anthropic's 401."""
    message = await _in_thread(
        keyed,
        lambda c: c.messages.create(model="sim-echo", max_tokens=5, messages=_user("ok")),
        api_key="sk-edge",
    )
    assert message.content[0].text == "ok"
    with pytest.raises(anthropic.AuthenticationError) as denied:
        await _in_thread(
            keyed,
            lambda c: c.messages.create(model="sim-echo", max_tokens=5, messages=_user("ok")),
            api_key="sk-wrong",
        )
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


async def test_disconnect_cancels_the_run_once(
    edge: RunningEdge, http: httpx.AsyncClient, sim: SimProcess
) -> None:
    """A client that leaves mid-stream: the run is cancelled on the node exactly once."""
    hang = script({"type": "delta", "delta": "partial"}, {"type": "hang"})
    body = {"model": "sim-script", "max_tokens": 5, "stream": True, "messages": _user(hang)}
    seen: list[dict[str, Any]] = []
    async with http.stream("POST", MESSAGES, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line.removeprefix("data: ")))
                if seen[-1]["type"] == "content_block_delta":
                    break
    assert seen[-1]["delta"] == {"type": "text_delta", "text": "partial"}
    run_id = seen[0]["message"]["id"].removeprefix("msg_")
    run = await sim.wait_run(run_id)
    assert run["outcome"] == "cancelled"
    assert run["cancel_rpcs"] == 1
    await edge.wait_idle()
    assert edge.outcome(run_id).status == "cancelled"


async def test_ping_while_waiting(nursery: trio.Nursery, sim: SimProcess) -> None:
    """While the first token is slow, the stream carries `ping` events after message_start,
    then the answer."""
    config = edge_config(sim)
    config = type(config)(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0.05),
        timeouts=config.timeouts,
        nodes=config.nodes,
    )
    running = await start_edge(nursery, config)
    # 1 s against 0.05 s: pings are due many times over, however loaded the machine.
    slow = script({"sleep_ms": 1000}, {"type": "delta", "delta": "late"}, {"type": "complete"})
    body = {"model": "sim-script", "max_tokens": 5, "stream": True, "messages": _user(slow)}
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
        text = (await client.post(MESSAGES, json=body)).text
    assert text.startswith("event: message_start\n")
    assert 'event: ping\ndata: {"type":"ping"}\n\n' in text
    assert text.index("event: ping") < text.index('"text":"late"')
    assert text.endswith('event: message_stop\ndata: {"type":"message_stop"}\n\n')
    await stop_edge(running)


async def test_shed_in_each_apis_shape(nursery: trio.Nursery, node: SimProcess) -> None:
    """With every slot held and the queue full, a new request is shed at once in its API's
    own error shape: Anthropic's 529 overloaded_error from the server (HTTP/1.1, before
    the body is read) and from the app (HTTP/2); OpenAI's 503 overloaded for responses."""
    async with (
        httpx.AsyncClient(timeout=WAIT_S) as http,
        trio.open_nursery() as waiting,
        trio.open_nursery() as holders,
    ):
        edge = await _full(nursery, node, http, waiting, holders)
        body = {"model": "sim-echo", "max_tokens": 5, "messages": _user("x")}
        async with httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as h1:
            shed = await h1.post(MESSAGES, json=body)
            assert shed.status_code == 529
            assert int(shed.headers["retry-after"]) >= 1
            assert shed.json()["type"] == "error"
            assert shed.json()["error"]["type"] == "overloaded_error"
            other = await h1.post("/v1/responses", json={"model": "sim-echo", "input": "x"})
            assert other.status_code == 503
            assert other.json()["error"]["type"] == "overloaded"
        async with httpx.AsyncClient(
            base_url=edge.url, http1=False, http2=True, timeout=WAIT_S
        ) as h2:
            response = await h2.post(MESSAGES, json=body)
            assert response.http_version == "HTTP/2"
            assert response.status_code == 529
            assert response.json()["error"]["type"] == "overloaded_error"
        holders.cancel_scope.cancel()
        waiting.cancel_scope.cancel()
    await stop_edge(edge)


# --- message_start's input tokens ---------------------------------------------------------


def _frames(raw: str) -> dict[str, dict[str, Any]]:
    """The data of each kind of SSE event in `raw`, the last one of each kind."""
    frames: dict[str, dict[str, Any]] = {}
    for frame in (f for f in raw.split("\n\n") if f.startswith("event: ")):
        event_line, data_line = frame.split("\n")
        frames[event_line.removeprefix("event: ")] = json.loads(data_line.removeprefix("data: "))
    return frames


async def test_message_start_carries_the_prompts_input_tokens(
    edge: RunningEdge, http: httpx.AsyncClient
) -> None:
    """A stream's `message_start` carries the prompt's input tokens, as Anthropic's does
    (LangChain's `@langchain/anthropic` reads them there only): the edge's estimate, the
    count `count_tokens` gives for the same request; `message_delta` keeps the node's
    count (sim-echo's: the prompt's words)."""
    prompt = {
        "model": "sim-echo", "system": "You answer in the words you were given.",
        "messages": _user("the quick brown fox jumps over the lazy dog " * 4),
    }  # fmt: skip
    counted = (await http.post(MESSAGES + "/count_tokens", json=prompt)).json()["input_tokens"]
    assert counted > 20
    body = {**prompt, "max_tokens": 64, "stream": True}
    raw = (await http.post(MESSAGES, json=body)).text
    frames = _frames(raw)
    start = frames["message_start"]["message"]["usage"]
    assert start == {
        "input_tokens": counted, "output_tokens": 0,
        "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0,
        "service_tier": "standard",
    }  # fmt: skip
    # The node's own count, at the end: sim-echo counts the messages' words.
    assert frames["message_delta"]["usage"]["input_tokens"] == 8 + 9 * 4

    def sdk_events(client: anthropic.Anthropic) -> tuple[int, int]:
        with client.messages.stream(max_tokens=64, **prompt) as stream:
            started = next(e for e in stream if e.type == "message_start")
            final = stream.get_final_message()
        return started.message.usage.input_tokens, final.usage.input_tokens

    started, final = await _in_thread(edge, sdk_events)
    assert (started, final) == (counted, 8 + 9 * 4)


async def test_message_start_matches_a_cache_models_count(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """On a node whose cache model counts the prompt as the edge does (characters / 4),
    `message_start`'s input tokens are the node's prompt tokens, the final message's
    input plus cache-read tokens, cold or warm (the SDK's streaming helper)."""
    node = await trio.to_thread.run_sync(
        lambda: start_sim(tmp_path, "kv", "--kv-tokens", "65536", "--prefill-us-per-token", "0")
    )
    try:
        running = await start_edge(nursery, edge_config(node))
        system = "You are a helpful assistant. " * 40  # several of the node's cache blocks

        def streamed(client: anthropic.Anthropic) -> tuple[int, Any]:
            with client.messages.stream(
                model="sim-echo", max_tokens=32, system=system, messages=_user("hi there")
            ) as stream:
                started = next(e for e in stream if e.type == "message_start")
                return started.message.usage.input_tokens, stream.get_final_message().usage

        for _ in range(2):  # cold, then most of the prompt cached
            started, usage = await _in_thread(running, streamed)
            assert started == usage.input_tokens + usage.cache_read_input_tokens > 256
        assert usage.cache_read_input_tokens > 0
        await stop_edge(running)
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)
