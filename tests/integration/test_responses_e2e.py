"""End to end: `POST /v1/responses` with the official openai SDK, through a real edge,
to an `iop-sim-node` process.

The same run and session as chat completions, rendered as the Responses API:
every test goes over a hypercorn socket and over gRPC to the simulated node,
and reads what the SDK's own parsers and stream accumulator make of it.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.integration.conftest import RunningEdge, SimProcess, script

RESPONSES = "/v1/responses"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
TOOL_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TERMINALS = {"response.completed", "response.incomplete", "response.failed"}


def _sdk(edge: RunningEdge) -> openai.OpenAI:
    return openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def _in_thread(edge: RunningEdge, call: Any) -> Any:
    def run() -> Any:
        with _sdk(edge) as client:
            return call(client)

    return await trio.to_thread.run_sync(run)


def _check_stream_order(events: list[Any]) -> None:
    """Sequence numbers 0..n-1, created then in_progress first, one terminal, last."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.type for e in events if e.type in TERMINALS] == [events[-1].type]


async def test_non_stream_echo(edge: RunningEdge, sim: SimProcess) -> None:
    """A non-streaming response: one message item with the text, status completed, usage."""
    response = await _in_thread(
        edge,
        lambda c: c.responses.create(
            model="sim-echo", input="hello big world", instructions="Be brief.", store=False
        ),
    )
    assert response.status == "completed"
    assert response.output_text == "hello big world"
    assert response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == "Be brief."
    run = await sim.wait_run(response.id.removeprefix("resp_"))
    assert run["outcome"] == "complete"


async def test_stream_events_in_order(edge: RunningEdge) -> None:
    """`create(stream=True)`: OpenAI's event order, text deltas adding up, one terminal."""
    events = await _in_thread(
        edge,
        lambda c: list(c.responses.create(model="sim-echo", input="one two three", stream=True)),
    )
    _check_stream_order(events)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "one two three"
    final = events[-1].response
    assert final.status == "completed"
    assert final.output_text == "one two three"
    assert final.usage.output_tokens > 0


async def test_stream_helper_final_response(edge: RunningEdge) -> None:
    """`client.responses.stream(...)`: the SDK's accumulator gives the final response."""

    def call(client: openai.OpenAI) -> Any:
        with client.responses.stream(model="sim-echo", input="stream me please") as stream:
            for _ in stream:
                pass
            return stream.get_final_response()

    final = await _in_thread(edge, call)
    assert final.output_text == "stream me please"
    assert final.status == "completed"


async def test_reasoning_item(edge: RunningEdge) -> None:
    """Reasoning from the node is a reasoning item (with its text) before the message."""
    body = script(
        {"type": "reasoning_delta", "delta": "Think "},
        {"type": "reasoning_delta", "delta": "hard."},
        {"type": "delta", "delta": "Answer."},
        {"type": "complete", "usage": {"input_tokens": 5, "output_tokens": 7,
                                       "reasoning_tokens": 3, "cached_input_tokens": 2}},
    )  # fmt: skip
    events = await _in_thread(
        edge, lambda c: list(c.responses.create(model="sim-script", input=body, stream=True))
    )
    _check_stream_order(events)
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "Think hard."
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Think hard."
    assert final.output_text == "Answer."
    usage = final.usage
    assert (usage.input_tokens, usage.output_tokens) == (5, 7)
    assert usage.output_tokens_details.reasoning_tokens == 3
    assert usage.input_tokens_details.cached_tokens == 2


REASONED = script(
    {"type": "reasoning_delta", "delta": "Think "},
    {"type": "reasoning_delta", "delta": "hard."},
    {"type": "delta", "delta": "Answer."},
    {"type": "complete"},
)


async def test_reasoning_summary_when_asked(edge: RunningEdge) -> None:
    """`reasoning: {"summary": ...}`: the node's reasoning is the reasoning item's summary
    (summary events streamed, in order, with the item's id and index), in the stream,
    the stream helper's final response and a non-streaming response alike."""

    def call(client: openai.OpenAI) -> tuple[list[Any], Any, Any]:
        asked: Any = {"summary": "detailed"}
        with client.responses.stream(model="sim-script", input=REASONED, reasoning=asked) as s:
            events = list(s)
            streamed = s.get_final_response()
        whole = client.responses.create(model="sim-script", input=REASONED,
                                        reasoning={"summary": "auto"})  # fmt: skip
        return events, streamed, whole

    events, streamed, whole = await _in_thread(edge, call)
    _check_stream_order(events)
    assert [e.type for e in events[2:9]] == [
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
    ]
    item_id = events[2].item.id
    assert {(e.item_id, e.output_index, e.summary_index) for e in events[3:8]} == {(item_id, 0, 0)}
    assert "".join(e.delta for e in events[4:6]) == "Think hard."
    assert not [e for e in events if e.type.startswith("response.reasoning_text")]
    for final in (events[-1].response, streamed, whole):
        assert [item.type for item in final.output] == ["reasoning", "message"]
        assert [(p.type, p.text) for p in final.output[0].summary] == [
            ("summary_text", "Think hard.")
        ]
        assert final.output_text == "Answer."


async def test_custom_tool_loop(edge: RunningEdge) -> None:
    """A custom (freeform) tool: the model's call is a custom_tool_call with its input
    (streamed with custom_tool_call_input events), sent back with its output as
    custom_tool_call_output, then the answer; `truncation: "auto"` is repeated as asked."""
    patch = {"id": "call_p", "name": "apply_patch", "arguments": {"input": "*** Begin Patch"}}
    turns = json.dumps({"turns": [
        {"events": [{"type": "complete", "tool_calls": [patch]}]},
        {"events": [{"type": "delta", "delta": "Patched."}, {"type": "complete"}]},
    ]})  # fmt: skip
    tool: Any = {"type": "custom", "name": "apply_patch", "description": "Edit files."}

    def loop(client: openai.OpenAI) -> tuple[list[Any], Any, Any]:
        with client.responses.stream(model="sim-script", input=turns, tools=[tool],
                                     truncation="auto") as stream:  # fmt: skip
            events = list(stream)
            first = stream.get_final_response()
        calls = [item for item in first.output if item.type == "custom_tool_call"]
        follow_up: list[Any] = [{"role": "user", "content": turns}]
        follow_up += [c.model_dump(exclude_none=True) for c in calls]
        follow_up += [{"type": "custom_tool_call_output", "call_id": c.call_id, "output": "ok"}
                      for c in calls]  # fmt: skip
        second = client.responses.create(model="sim-script", input=follow_up, tools=[tool])
        return events, first, second

    events, first, second = await _in_thread(edge, loop)
    _check_stream_order(events)
    kinds = [e.type for e in events]
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]
    (call,) = first.output
    assert (call.type, call.name, call.call_id, call.input) == (
        "custom_tool_call", "apply_patch", "call_p", "*** Begin Patch",
    )  # fmt: skip
    assert first.truncation == "auto"
    assert [t.type for t in first.tools] == ["custom"]
    assert second.output_text == "Patched."


async def test_two_turn_tool_loop(edge: RunningEdge, sim: SimProcess) -> None:
    """A function call, its output sent back as function_call_output, then the answer."""
    turns = json.dumps({"turns": [
        {"events": [{"type": "delta", "delta": TOOL_CALL}, {"type": "complete"}]},
        {"events": [{"type": "delta", "delta": "It is sunny."}, {"type": "complete"}]},
    ]})  # fmt: skip

    def loop(client: openai.OpenAI) -> tuple[Any, Any]:
        first = client.responses.create(model="sim-script", input=turns, tools=[WEATHER])
        calls = [item for item in first.output if item.type == "function_call"]
        follow_up: list[Any] = [{"role": "user", "content": turns}]
        follow_up += [c.model_dump(exclude_none=True) for c in calls]
        follow_up += [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
                      for c in calls]  # fmt: skip
        second = client.responses.create(model="sim-script", input=follow_up, tools=[WEATHER])
        return first, second

    first, second = await _in_thread(edge, loop)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].call_id
    assert first.output_text == ""
    assert second.output_text == "It is sunny."
    assert second.status == "completed"


async def test_stream_function_call_events(edge: RunningEdge) -> None:
    """A streamed call: output_item.added, arguments delta and done, output_item.done."""
    body = script({"type": "delta", "delta": TOOL_CALL}, {"type": "complete"})

    def call(client: openai.OpenAI) -> tuple[list[Any], Any]:
        with client.responses.stream(model="sim-script", input=body, tools=[WEATHER]) as stream:
            events = list(stream)
            return events, stream.get_final_response()

    events, final = await _in_thread(edge, call)
    _check_stream_order(events)
    kinds = [e.type for e in events]
    start = kinds.index("response.function_call_arguments.delta")
    assert kinds[start - 1 : start + 3] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    (item,) = [i for i in final.output if i.type == "function_call"]
    assert json.loads(item.arguments) == {"city": "Paris"}


async def test_max_tokens_is_incomplete(edge: RunningEdge) -> None:
    """finish_reason length: `response.incomplete` with reason max_output_tokens."""
    body = script(
        {"type": "delta", "delta": "cut"},
        {"type": "complete", "metadata": {"finish_reason": "length"}},
    )
    events = await _in_thread(
        edge,
        lambda c: list(
            c.responses.create(model="sim-script", input=body, max_output_tokens=1, stream=True)
        ),
    )
    _check_stream_order(events)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    non_stream = await _in_thread(
        edge, lambda c: c.responses.create(model="sim-script", input=body, max_output_tokens=1)
    )
    assert non_stream.status == "incomplete"
    assert non_stream.output_text == "cut"


async def test_run_error_mid_stream_is_failed(edge: RunningEdge) -> None:
    """A node error after output began: `response.failed` with the error, the last event."""
    body = script({"type": "delta", "delta": "partial"}, {"type": "error", "error": "boom"})
    events = await _in_thread(
        edge, lambda c: list(c.responses.create(model="sim-script", input=body, stream=True))
    )
    _check_stream_order(events)
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.message == "boom"
    assert events[-1].response.error.code == "run_error"


async def test_tool_validation_failure_is_failed(edge: RunningEdge) -> None:
    """A call that breaks the declared schema is `response.failed` once the stream began,
    a 422 before its first byte; never a silent success."""
    bad = '<tool_call>{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>'
    body = script({"type": "delta", "delta": "Checking. "}, {"type": "delta", "delta": bad},
                  {"type": "complete"})  # fmt: skip
    events = await _in_thread(
        edge,
        lambda c: list(
            c.responses.create(model="sim-script", input=body, tools=[WEATHER], stream=True)
        ),
    )
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "tool_validation_error"
    with pytest.raises(openai.UnprocessableEntityError):
        await _in_thread(
            edge, lambda c: c.responses.create(model="sim-script", input=body, tools=[WEATHER])
        )


async def test_errors_are_sdk_exceptions(edge: RunningEdge) -> None:
    """Refused requests: statuses the SDK maps to its exception classes (references the
    store does not hold: 404; `conversation`: 400, the edge keeps none)."""
    with pytest.raises(openai.NotFoundError, match="'resp_123' not found"):
        await _in_thread(
            edge,
            lambda c: c.responses.create(
                model="sim-echo", input="hi", previous_response_id="resp_123"
            ),
        )
    with pytest.raises(openai.BadRequestError, match="keeps no state"):
        await _in_thread(
            edge,
            lambda c: c.responses.create(model="sim-echo", input="hi", conversation="conv_1"),
        )
    with pytest.raises(openai.NotFoundError):
        await _in_thread(edge, lambda c: c.responses.create(model="no-such-model", input="hi"))
    with pytest.raises(openai.NotFoundError, match="'msg_1'"):
        await _in_thread(
            edge, lambda c: c.responses.create(model="sim-echo", input=[{"type": "item_reference",
                                                                       "id": "msg_1"}])
        )  # fmt: skip
    body = script({"type": "error", "error": "node said no"})
    with pytest.raises(openai.InternalServerError, match="node said no"):
        await _in_thread(edge, lambda c: c.responses.create(model="sim-script", input=body))


async def test_json_schema_text_format(edge: RunningEdge) -> None:
    """text.format json_schema reaches the run as response_format (strict output holds)."""
    fmt = {"type": "json_schema", "name": "city", "strict": True,
           "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"], "additionalProperties": False}}  # fmt: skip
    body = script({"type": "delta", "delta": '{"city": "Paris"}'}, {"type": "complete"})
    response = await _in_thread(
        edge,
        lambda c: c.responses.create(model="sim-script", input=body, text={"format": fmt}),
    )
    assert json.loads(response.output_text) == {"city": "Paris"}
    assert response.text.format.type == "json_schema"


async def test_raw_stream_frames(http: httpx.AsyncClient) -> None:
    """The raw SSE: each frame an `event:` line and a `data:` line of the same type."""
    body = {"model": "sim-echo", "input": "hi there", "stream": True}
    async with http.stream("POST", RESPONSES, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = await response.aread()
    frames = [f for f in raw.decode().split("\n\n") if f and not f.startswith(":")]
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert json.loads(data_line.removeprefix("data: "))["type"] == event_line.removeprefix(
            "event: "
        )


async def test_disconnect_cancels_the_run_once(
    edge: RunningEdge, http: httpx.AsyncClient, sim: SimProcess
) -> None:
    """A client that leaves mid-stream: the run is cancelled on the node exactly once."""
    body = {"model": "sim-script", "stream": True,
            "input": script({"type": "delta", "delta": "partial"}, {"type": "hang"})}  # fmt: skip
    seen: list[dict[str, Any]] = []
    async with http.stream("POST", RESPONSES, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line.removeprefix("data: ")))
                if seen[-1]["type"] == "response.output_text.delta":
                    break
    assert seen[-1]["delta"] == "partial"
    run_id = seen[0]["response"]["id"].removeprefix("resp_")
    run = await sim.wait_run(run_id)
    assert run["outcome"] == "cancelled"
    assert run["cancel_rpcs"] == 1
    await edge.wait_idle()
    assert edge.outcome(run_id).status == "cancelled"
