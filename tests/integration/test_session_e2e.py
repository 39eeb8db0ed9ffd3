"""The stream session's main scenarios end to end: openai SDK -> real edge -> iop-sim-node.

Each test plays a `sim-script` run (the sim models use reasoning_parser "think",
so `<think>` written into content deltas becomes reasoning) and checks what the
official SDK sees, streaming and not, over real sockets.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pydantic
import pytest
import trio

from tests.integration.conftest import WEATHER_TOOL, RunningEdge, chat_body, script

USAGE = {"input_tokens": 9, "output_tokens": 4, "reasoning_tokens": 3, "cached_input_tokens": 5}


def _sdk(edge: RunningEdge) -> openai.OpenAI:
    return openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _messages(*events: dict[str, Any]) -> Any:
    return [{"role": "user", "content": script(*events)}]


def delta(text: str) -> dict[str, Any]:
    return {"type": "delta", "delta": text}


def reasoning(text: str) -> dict[str, Any]:
    return {"type": "reasoning_delta", "delta": text}


def complete(finish_reason: str = "stop", **extra: Any) -> dict[str, Any]:
    return {
        "type": "complete",
        "usage": USAGE,
        "metadata": {"finish_reason": finish_reason},
        **extra,
    }


async def stream(
    edge: RunningEdge, *events: dict[str, Any], **kwargs: Any
) -> tuple[list[Any], openai.APIError | None]:
    """Stream a sim-script run with the SDK: the chunks received, and the error that ended it."""

    def call() -> tuple[list[Any], openai.APIError | None]:
        chunks: list[Any] = []
        with _sdk(edge) as client:
            try:
                for chunk in client.chat.completions.create(
                    model="sim-script", messages=_messages(*events), stream=True, **kwargs
                ):
                    chunks.append(chunk)
            except openai.APIError as exc:
                return chunks, exc
        return chunks, None

    return await trio.to_thread.run_sync(call)


async def create(edge: RunningEdge, *events: dict[str, Any], **kwargs: Any) -> Any:
    """The non-streaming completion of a sim-script run."""

    def call() -> Any:
        with _sdk(edge) as client:
            return client.chat.completions.create(
                model="sim-script", messages=_messages(*events), **kwargs
            )

    return await trio.to_thread.run_sync(call)


def content(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def reasoning_of(chunks: list[Any]) -> str:
    return "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )


def finish_reason(chunks: list[Any]) -> str | None:
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return reasons[-1] if reasons else None


THINKING = (
    reasoning("plan: "),
    delta("<think>add "),
    delta("them</thi"),
    delta("nk>The sum"),
    delta(" is 4."),
    complete(),
)


async def test_reasoning_exposed_with_think_tags(edge: RunningEdge) -> None:
    """By default reasoning_delta and <think> blocks in content reach the caller as
    reasoning_content; the tags never appear; the role chunk comes first."""
    chunks, error = await stream(edge, *THINKING)
    assert error is None
    assert chunks[0].choices[0].delta.role == "assistant"
    assert content(chunks) == "The sum is 4."
    assert reasoning_of(chunks) == "plan: add them"
    assert finish_reason(chunks) == "stop"


@pytest.mark.parametrize(
    "extra",
    [{"include_reasoning": False}, {"reasoning": {"exclude": True}}],
    ids=["flag", "exclude"],
)
async def test_reasoning_hidden_when_turned_off(edge: RunningEdge, extra: dict[str, Any]) -> None:
    """With reasoning turned off (either dialect) no reasoning_content is sent; content is
    unchanged and think tags are still removed."""
    chunks, error = await stream(edge, *THINKING, extra_body=extra)
    assert error is None
    assert reasoning_of(chunks) == ""
    assert content(chunks) == "The sum is 4."


@pytest.mark.parametrize(
    ("extra", "shown"),
    [({}, ""), ({"include_reasoning": True}, "plan: add them")],
    ids=["implicit", "explicit"],
)
async def test_strict_output_hides_reasoning_unless_explicit(
    edge: RunningEdge, extra: dict[str, Any], shown: str
) -> None:
    """strict_output hides reasoning unless the caller asked for it explicitly."""
    chunks, error = await stream(edge, *THINKING, extra_body={"strict_output": True, **extra})
    assert error is None
    assert reasoning_of(chunks) == shown
    assert content(chunks) == "The sum is 4."


async def test_sentinels_removed_across_deltas(edge: RunningEdge) -> None:
    """Leaked special tokens are removed from content and reasoning, even split over deltas."""
    chunks, error = await stream(
        edge,
        reasoning("hm<|eot"),
        reasoning("_id|>m"),
        delta("Hello<|im_"),
        delta("end|> world</s>"),
        complete(),
    )
    assert error is None
    assert content(chunks) == "Hello world"
    assert reasoning_of(chunks) == "hmm"


@pytest.mark.parametrize(
    ("extra", "reasoning_shown"),
    [({}, True), ({"include_reasoning": False}, False)],
    ids=["with-reasoning", "hidden"],
)
async def test_reasoning_only_fallback(
    edge: RunningEdge, extra: dict[str, Any], reasoning_shown: bool
) -> None:
    """A run that only reasons gets a placeholder answer keyed by finish_reason; it carries
    the reasoning only when the caller asked for reasoning."""
    chunks, error = await stream(
        edge, delta("<think>ran out of room"), complete("length"), extra_body=extra
    )
    assert error is None
    text = content(chunks)
    assert text.startswith("[")
    assert ("ran out of room" in text) is reasoning_shown
    assert finish_reason(chunks) == "length"


async def test_strict_stream_buffer_invalid_json_sends_no_content(
    edge: RunningEdge, http: httpx.AsyncClient
) -> None:
    """strict + stream_buffer + json_object: invalid output ends in output_validation_error
    and not one content byte went out before it."""
    events = (delta('{"answer": '), delta("oops"), complete())
    extra = {"strict_output": True, "stream_buffer": True}
    chunks, error = await stream(
        edge, *events, response_format={"type": "json_object"}, extra_body=extra
    )
    assert isinstance(error, openai.APIError)
    assert "valid JSON" in error.message
    assert content(chunks) == ""

    body = chat_body(
        "sim-script", script(*events), stream=True, response_format={"type": "json_object"}, **extra
    )
    raw = (await http.post("/v1/chat/completions", json=body)).content.decode()
    frames = [f.removeprefix("data: ") for f in raw.split("\n\n") if f]
    assert '"content"' not in raw
    assert "[DONE]" not in frames
    assert json.loads(frames[-1])["error"]["type"] == "output_validation_error"


async def test_strict_stream_buffer_valid_json_is_released(edge: RunningEdge) -> None:
    """strict + stream_buffer + json_schema: valid output is released whole, then finish."""
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": {"type": "object", "required": ["n"]}},
    }
    chunks, error = await stream(
        edge,
        delta('{"n"'),
        delta(": 4}"),
        complete(),
        response_format=fmt,
        extra_body={"strict_output": True, "stream_buffer": True},
    )
    assert error is None
    assert json.loads(content(chunks)) == {"n": 4}
    assert finish_reason(chunks) == "stop"


async def test_strict_invalid_json_non_streaming_is_422(edge: RunningEdge) -> None:
    """Non-streaming, the same validation failure is a 422 output_validation_error."""
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        await create(
            edge,
            delta("not json"),
            complete(),
            response_format={"type": "json_object"},
            extra_body={"strict_output": True},
        )
    assert caught.value.body is not None
    assert caught.value.body["type"] == "output_validation_error"  # type: ignore[index]


class City(pydantic.BaseModel):
    city: str


async def test_a_strict_json_schema_is_checked_as_openai_guarantees_it(
    edge: RunningEdge, http: httpx.AsyncClient
) -> None:
    """`response_format` json_schema with `strict: true` (what Outlines, the Agents SDK and
    the SDK's `parse` send) has the answer checked against the schema, whatever the
    model's strict policy: `{"city": 5}` is a 422 `output_validation_error` (chat's
    `parse`, the Responses API's `parse`), an error frame when streamed; a matching
    answer parses; without `strict: true` the same answer passes as the node gave it."""
    bad = script(delta('{"city": 5}'), complete())
    good = script(delta('{"city": "Paris"}'), complete())

    def sdk() -> tuple[Any, ...]:
        user = [{"role": "user", "content": bad}]
        with _sdk(edge) as client:
            with pytest.raises(openai.UnprocessableEntityError) as chat:
                client.chat.completions.parse(
                    model="sim-script", messages=user, response_format=City
                )
            with pytest.raises(openai.APIStatusError) as responses:
                client.responses.parse(model="sim-script", input=bad, text_format=City, store=False)
            parsed = client.chat.completions.parse(
                model="sim-script",
                messages=[{"role": "user", "content": good}],
                response_format=City,
            )
        return chat.value, responses.value, parsed.choices[0].message.parsed

    chat, responses, parsed = await trio.to_thread.run_sync(sdk)
    assert chat.body["type"] == "output_validation_error", chat.body
    assert "response_format json_schema" in chat.body["message"]
    assert responses.status_code == 422
    assert "output_validation_error" in str(responses.body)
    assert parsed == City(city="Paris")

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    strict_format = {
        "type": "json_schema",
        "json_schema": {"name": "c", "schema": schema, "strict": True},
    }
    streamed = chat_body("sim-script", bad, stream=True, response_format=strict_format)
    raw = (await http.post("/v1/chat/completions", json=streamed)).text
    frames = [f.removeprefix("data: ") for f in raw.split("\n\n") if f]
    assert json.loads(frames[-1])["error"]["type"] == "output_validation_error"
    assert "[DONE]" not in frames

    loose = {**strict_format, "json_schema": {"name": "c", "schema": schema}}
    answer = await http.post(
        "/v1/chat/completions", json=chat_body("sim-script", bad, response_format=loose)
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == '{"city": 5}'


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({"type": "error", "error": "GPU on fire", "message": "ignored"}, "GPU on fire"),
        ({"type": "error", "message": "only a message"}, "only a message"),
        ({"type": "cancelled"}, "run failed"),
    ],
)
async def test_node_error_and_cancelled_events(
    edge: RunningEdge, event: dict[str, Any], message: str
) -> None:
    """A node error/cancelled event ends the stream with a run_error whose message is the
    event's error, else its message, else "run failed"; the content before it was streamed.
    Non-streaming, it is a 502 with the same error."""
    chunks, error = await stream(edge, delta("partial"), event)
    assert isinstance(error, openai.APIError)
    assert error.message == message
    assert content(chunks) == "partial"

    with pytest.raises(openai.InternalServerError) as caught:
        await create(edge, delta("partial"), event)
    assert caught.value.status_code == 502
    assert caught.value.body == {
        "message": message,
        "type": "run_error",
        "param": None,
        "code": None,
    }


async def test_usage_with_include_usage(edge: RunningEdge) -> None:
    """include_usage: one last chunk with no choices carries the node's usage, mapped to
    OpenAI's fields (cached and reasoning tokens in the details)."""
    chunks, error = await stream(
        edge, delta("hi"), complete(), stream_options={"include_usage": True}
    )
    assert error is None
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (9, 4, 13)
    assert usage.prompt_tokens_details.cached_tokens == 5
    assert usage.completion_tokens_details.reasoning_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


async def test_non_streaming_renders_the_same_session(edge: RunningEdge) -> None:
    """The non-streaming answer of the same run has the same content, reasoning,
    finish_reason and usage as the stream."""
    completion = await create(edge, *THINKING)
    choice = completion.choices[0]
    assert choice.message.content == "The sum is 4."
    assert getattr(choice.message, "reasoning_content", None) == "plan: add them"
    assert choice.finish_reason == "stop"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (9, 4)

    hidden = await create(edge, *THINKING, extra_body={"include_reasoning": False})
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None
    assert hidden.choices[0].message.content == "The sum is 4."


async def test_tool_calls_from_text(edge: RunningEdge) -> None:
    """With tools declared, tool-call markup in content becomes a tool_calls delta; the
    markup never reaches the caller; finish_reason is tool_calls."""
    tools = [WEATHER_TOOL]
    chunks, error = await stream(
        edge,
        delta("Checking.\n<tool_"),
        delta('call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
        complete(),
        tools=tools,
    )
    assert error is None
    assert content(chunks) == "Checking."
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert finish_reason(chunks) == "tool_calls"
