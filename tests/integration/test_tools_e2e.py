"""End to end: tool calls through a real edge to `iop-sim-node`, seen by the openai SDK.

Each `sim-script` plays a realistic model output token by token (small
deltas that cut the markup anywhere) with tools declared. Streaming answers
are accumulated by the SDK's own `ChatCompletionStreamState`, so what is
checked is what an agent built on the SDK would get.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from itertools import cycle
from typing import Any

import httpx
import openai
import pytest
import trio
from openai.lib.streaming.chat import ChatCompletionStreamState

from edge.config import ModelConfig
from edge.stream.toolparse import DEFAULT_FORMATS
from edge.stream.toolparse import FORMATS as ALL_FORMATS
from tests.integration.conftest import (
    WEATHER_TOOL,
    RunningEdge,
    SimProcess,
    chat_body,
    edge_config,
    script,
    start_edge,
    stop_edge,
)
from tests.integration.test_chat_e2e import parse_sse

CHAT = "/v1/chat/completions"
WEATHER = WEATHER_TOOL
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
TOOLS: list[Any] = [WEATHER, TIME]
PARIS = {"city": "Paris", "unit": "celsius"}
# Delta sizes cycled over the text: tags and JSON get cut at many different points.
SIZES = (1, 3, 2, 5, 4, 7)

Call = tuple[str, dict[str, Any]]


def _pieces(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    sizes = cycle(SIZES)
    while pos < len(text):
        size = next(sizes)
        out.append(text[pos : pos + size])
        pos += size
    return out


def model_output(text: str, *, big: bool = False, **metadata: Any) -> str:
    """A sim-script that streams `text` in small deltas (`big`: 500 characters), then
    completes with `metadata`."""
    pieces = [text[i : i + 500] for i in range(0, len(text), 500)] if big else _pieces(text)
    deltas = [{"type": "delta", "delta": piece} for piece in pieces]
    return script(
        *deltas,
        {"type": "complete", "metadata": {"finish_reason": "stop", **metadata}},
    )


# sim-script with every text format parsed (the default is the tag formats only).
ALL_FORMATS_MODEL = ModelConfig(reasoning_parser="think", tool_call_formats=ALL_FORMATS)


@pytest.fixture
async def formats_edge(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[RunningEdge]:
    """An edge whose sim-script model parses every text format, bare and fenced JSON too."""
    config = replace(edge_config(sim), models={"sim-script": ALL_FORMATS_MODEL})
    running = await start_edge(nursery, config)
    yield running
    await stop_edge(running)


def _sdk(edge: RunningEdge) -> openai.OpenAI:
    return openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _request(content: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "sim-script",
        "messages": [{"role": "user", "content": content}],
        "tools": TOOLS,
        **kwargs,
    }


async def stream(edge: RunningEdge, content: str, **kwargs: Any) -> tuple[list[Any], Any]:
    """The chunks of a streamed answer, and the SDK's accumulated completion."""

    def call() -> tuple[list[Any], Any]:
        state: ChatCompletionStreamState[Any] = ChatCompletionStreamState(
            input_tools=kwargs.get("tools", TOOLS)
        )
        chunks = []
        with _sdk(edge) as client:
            for chunk in client.chat.completions.create(**_request(content, kwargs), stream=True):
                chunks.append(chunk)
                state.handle_chunk(chunk)
        return chunks, state.get_final_completion()

    return await trio.to_thread.run_sync(call)


async def create(edge: RunningEdge, content: str, **kwargs: Any) -> Any:
    """A non-streamed answer."""

    def call() -> Any:
        with _sdk(edge) as client:
            return client.chat.completions.create(**_request(content, kwargs))

    return await trio.to_thread.run_sync(call)


async def stream_error(edge: RunningEdge, content: str, **kwargs: Any) -> openai.APIError:
    """The APIError the SDK raised for a stream's error frame (the chunks before it are read)."""

    def call() -> openai.APIError:
        with _sdk(edge) as client:
            try:
                for _ in client.chat.completions.create(**_request(content, kwargs), stream=True):
                    pass
            except openai.APIError as exc:
                return exc
        raise AssertionError("the stream ended without an error frame")

    return await trio.to_thread.run_sync(call)


async def create_error(edge: RunningEdge, content: str, **kwargs: Any) -> openai.APIStatusError:
    def call() -> openai.APIStatusError:
        with _sdk(edge) as client:
            try:
                client.chat.completions.create(**_request(content, kwargs))
            except openai.APIStatusError as exc:
                return exc
        raise AssertionError("the request succeeded")

    return await trio.to_thread.run_sync(call)


def calls_of(tool_calls: list[Any] | None) -> list[Call]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


def streamed_content(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def tool_call_chunks(chunks: list[Any]) -> list[Any]:
    return [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]


def check_streamed_calls(chunks: list[Any], final: Any, expected: list[Call]) -> None:
    """One tool_calls delta, complete per call, that the SDK accumulates into `expected`."""
    deltas = tool_call_chunks(chunks)
    assert len(deltas) == 1, "all calls arrive in one tool_calls delta"
    items = deltas[0].choices[0].delta.tool_calls
    assert [item.index for item in items] == list(range(len(expected)))
    for item in items:
        assert item.type == "function"
        assert item.id
        assert item.function.name
        json.loads(item.function.arguments)  # a JSON string, whole
    at = chunks.index(deltas[0])
    assert at == len(chunks) - 2, "the calls come right before the finish chunk"
    assert not streamed_content(chunks[at:]), "all content comes before the calls"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    message = final.choices[0].message
    assert calls_of(message.tool_calls) == expected
    ids = [c.id for c in message.tool_calls]
    assert ids == [item.id for item in items]
    assert len(set(ids)) == len(ids), "ids are unique"
    assert all(c.type == "function" for c in message.tool_calls)
    assert final.choices[0].finish_reason == "tool_calls"


# --- the text formats ---------------------------------------------------------

FORMATS: list[tuple[str, str, str, list[Call]]] = [
    (
        "hermes",
        "Let me check the weather for you.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>",
        "Let me check the weather for you.",
        [("get_weather", PARIS)],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "mistral-args",
        'I will look it up.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
        "I will look it up.",
        [("get_weather", PARIS)],
    ),
    (
        "llama",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
        '"unit": "celsius"}}<|eom_id|>',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "json",
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "json-after-prose",
        "Checking the forecast.\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n',
        "Checking the forecast.",
        [("get_weather", PARIS)],
    ),
    (
        "fenced",
        "I'll call the weather tool.\n```json\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n```\n',
        "I'll call the weather tool.",
        [("get_weather", PARIS)],
    ),
]
FORMAT_IDS = [case[0] for case in FORMATS]


@pytest.mark.parametrize(("fmt", "text", "cleaned", "expected"), FORMATS, ids=FORMAT_IDS)
async def test_text_format_streaming(
    formats_edge: RunningEdge, fmt: str, text: str, cleaned: str, expected: list[Call]
) -> None:
    """Streamed (every format configured): the SDK accumulates the calls written as text;
    content is the text without markup, never a byte of it; finish_reason tool_calls."""
    chunks, final = await stream(formats_edge, model_output(text))
    check_streamed_calls(chunks, final, expected)
    assert streamed_content(chunks) == cleaned
    assert (final.choices[0].message.content or "") == cleaned


@pytest.mark.parametrize(("fmt", "text", "cleaned", "expected"), FORMATS, ids=FORMAT_IDS)
async def test_text_format_non_streaming(
    formats_edge: RunningEdge, fmt: str, text: str, cleaned: str, expected: list[Call]
) -> None:
    """Not streamed (every format configured): message.tool_calls holds the calls; content
    is the cleaned text or None."""
    completion = await create(formats_edge, model_output(text))
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls"
    assert calls_of(message.tool_calls) == expected
    assert all(c.id and c.type == "function" for c in message.tool_calls)
    assert message.content == (cleaned or None)


PARALLEL: list[tuple[str, str, str]] = [
    (
        "hermes",
        "Checking both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "Checking both.",
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        "",
    ),
    (
        "llama",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        "",
    ),
]
PARALLEL_CALLS: list[Call] = [("get_weather", PARIS), ("get_time", {"tz": "Europe/Paris"})]


@pytest.mark.parametrize(("fmt", "text", "cleaned"), PARALLEL, ids=[p[0] for p in PARALLEL])
async def test_parallel_calls_in_order(
    edge: RunningEdge, fmt: str, text: str, cleaned: str
) -> None:
    """Several calls in one completion arrive in the order written, with distinct ids and
    indexes 0..n-1, streamed and not."""
    chunks, final = await stream(edge, model_output(text))
    check_streamed_calls(chunks, final, PARALLEL_CALLS)
    assert streamed_content(chunks) == cleaned
    completion = await create(edge, model_output(text))
    tool_calls = completion.choices[0].message.tool_calls
    assert calls_of(tool_calls) == PARALLEL_CALLS
    assert len({c.id for c in tool_calls}) == 2


async def test_reasoning_then_call(edge: RunningEdge) -> None:
    """A thinking model (Qwen3 style): the think block is reasoning, the call after it is a
    call, and no placeholder content is made up for the empty answer."""
    text = "<think>\nThe user wants the weather in Paris.\n</think>\n\n" + (
        "<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>"
    )
    chunks, final = await stream(edge, model_output(text))
    check_streamed_calls(chunks, final, [("get_weather", PARIS)])
    assert streamed_content(chunks) == ""
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert "weather in Paris" in reasoning


async def test_raw_sse_tool_calls_delta(http: httpx.AsyncClient) -> None:
    """The exact frames: role, cleaned content, one tool_calls delta with index/id/type/
    function.name/function.arguments (a JSON string), the tool_calls finish, [DONE]."""
    text = (
        "One moment.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    )
    body = chat_body("sim-script", model_output(text), tools=TOOLS, stream=True)
    async with http.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    payloads = parse_sse(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    run_id = chunks[0]["id"].removeprefix("chatcmpl-")
    assert deltas[0] == {"role": "assistant"}
    assert "".join(d.get("content", "") for d in deltas) == "One moment."
    assert "<tool_call>" not in raw.decode()
    assert "</tool_call>" not in raw.decode()
    assert deltas[-2] == {
        "tool_calls": [
            {
                "index": 0,
                "id": f"call_{run_id}_0",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city":"Paris","unit":"celsius"}',
                },
            }
        ]
    }
    assert deltas[-1] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# --- native calls: typed, and from the run metadata of older nodes -----------------

NATIVE_OVER_TEXT = (
    "Sure, checking now.\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
)
NATIVE = [
    {
        "id": "call_native_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
]


async def test_native_calls_win_over_text_streaming(edge: RunningEdge) -> None:
    """Native calls in the complete metadata win over markup streamed before: the call is the
    native one, and only the safe prefix before the markup was streamed."""
    chunks, final = await stream(edge, model_output(NATIVE_OVER_TEXT, tool_calls=NATIVE))
    check_streamed_calls(chunks, final, [("get_weather", {"city": "Rome"})])
    assert streamed_content(chunks) == "Sure, checking now."
    item = tool_call_chunks(chunks)[0].choices[0].delta.tool_calls[0]
    assert item.id == "call_native_1"
    assert item.function.arguments == '{"city":"Rome"}'


async def test_native_calls_win_over_text_non_streaming(edge: RunningEdge) -> None:
    """Not streamed: the native call, and only the content before the markup."""
    completion = await create(edge, model_output(NATIVE_OVER_TEXT, tool_calls=NATIVE))
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("call_native_1", "get_weather", '{"city":"Rome"}')
    ]
    assert message.content == "Sure, checking now."


async def test_native_calls_are_normalized(edge: RunningEdge) -> None:
    """Native calls without ids, in the flat form, with object or empty arguments and a
    differently cased name get unique ids, type function, JSON-string arguments and the
    declared name; plain text before them is streamed whole."""
    native = [
        {"name": "GET_WEATHER", "arguments": {"city": "Oslo"}},
        {"function": {"name": "get_time", "arguments": ""}},
    ]
    chunks, final = await stream(edge, model_output("Two lookups.", tool_calls=native))
    check_streamed_calls(chunks, final, [("get_weather", {"city": "Oslo"}), ("get_time", {})])
    assert streamed_content(chunks) == "Two lookups."
    items = tool_call_chunks(chunks)[0].choices[0].delta.tool_calls
    assert [i.function.arguments for i in items] == ['{"city":"Oslo"}', "{}"]


def typed_output(text: str, calls: list[dict[str, Any]]) -> str:
    """A sim-script streaming `text`, then completing with `calls` in the typed field."""
    deltas = [{"type": "delta", "delta": piece} for piece in _pieces(text)]
    complete = {"type": "complete", "metadata": {"finish_reason": "stop"}, "tool_calls": calls}
    return script(*deltas, complete)


async def test_typed_native_calls_streaming_and_non_streaming(edge: RunningEdge) -> None:
    """Native calls in the contract's typed field win over markup, streamed or not: a given
    id is kept, a missing one chosen, arguments compacted, the declared name matched."""
    calls = [
        {"id": "call_typed_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"id": "", "name": "GET_TIME", "arguments": ""},
    ]
    expected = [("get_weather", {"city": "Rome"}), ("get_time", {})]
    chunks, final = await stream(edge, typed_output(NATIVE_OVER_TEXT, calls))
    check_streamed_calls(chunks, final, expected)
    assert streamed_content(chunks) == "Sure, checking now."
    items = tool_call_chunks(chunks)[0].choices[0].delta.tool_calls
    assert items[0].id == "call_typed_1"
    assert [i.function.arguments for i in items] == ['{"city":"Rome"}', "{}"]
    completion = await create(edge, typed_output(NATIVE_OVER_TEXT, calls))
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls"
    assert calls_of(message.tool_calls) == expected
    assert message.tool_calls[0].id == "call_typed_1"
    assert message.content == "Sure, checking now."


async def test_typed_native_call_without_name_is_not_dropped(edge: RunningEdge) -> None:
    """A typed call with no name is a tool_validation_error, as in the JSON form."""
    calls = [{"id": "c1", "name": "", "arguments": "{}"}]
    error = await stream_error(edge, typed_output("Checking.", calls))
    assert error.type == "tool_validation_error"
    status = await create_error(edge, typed_output("Checking.", calls))
    assert status.status_code == 422


@pytest.mark.parametrize(
    "native",
    [
        '[{"name": "get_weather", "arguments": {"city": "Par',
        [{"name": "get_time", "arguments": {}}, {"arguments": {"city": "Paris"}}],
    ],
    ids=["truncated-json", "entry-without-name"],
)
async def test_broken_native_calls_are_not_dropped(edge: RunningEdge, native: Any) -> None:
    """Native tool_calls metadata that cannot be read whole (bad JSON, an entry with no name)
    is a tool_validation_error, not an answer with the calls silently dropped."""
    error = await stream_error(edge, model_output("Checking.", tool_calls=native))
    assert error.type == "tool_validation_error"
    assert "tool_calls" in error.message
    status = await create_error(edge, model_output("Checking.", tool_calls=native))
    assert status.status_code == 422


# --- validation ---------------------------------------------------------------


def hermes(name: str, arguments: dict[str, Any]) -> str:
    call = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{call}\n</tool_call>"


VIOLATIONS: list[tuple[str, str, dict[str, Any], list[str]]] = [
    (
        "undeclared-name",
        "Launching.\n" + hermes("launch_rockets", {"count": 3}),
        {},
        ['"launch_rockets"', "no declared tool"],
    ),
    (
        "schema-type",
        hermes("get_weather", {"city": 42}),
        {},
        ['"get_weather"', "'type'", "$.city"],
    ),
    (
        "schema-required",
        hermes("get_weather", {"unit": "celsius"}),
        {},
        ['"get_weather"', "'required'"],
    ),
    (
        "schema-enum",
        hermes("get_weather", {"city": "Paris", "unit": "kelvin"}),
        {},
        ['"get_weather"', "'enum'"],
    ),
    (
        "arguments-not-an-object",
        '<tool_call>{"name": "get_weather", "arguments": "[1, 2]"}</tool_call>',
        {},
        ['"get_weather"', "not a JSON object"],
    ),
    (
        "unparsable-call",
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
        {},
        ["not valid JSON"],
    ),
    (
        "tool-choice-none",
        hermes("get_weather", {"city": "Paris"}),
        {"tool_choice": "none"},
        ['"get_weather"', 'tool_choice is "none"'],
    ),
    (
        "tool-choice-required",
        "It is sunny in Paris.",
        {"tool_choice": "required"},
        ['"required"', "no tool call"],
    ),
    (
        "tool-choice-named",
        hermes("get_weather", {"city": "Paris"}),
        {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        ['"get_time"', '"get_weather"'],
    ),
    (
        "parallel-false",
        hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("get_time", {}),
        {"parallel_tool_calls": False},
        ["parallel_tool_calls is false", '"get_weather"', '"get_time"'],
    ),
]
VIOLATION_IDS = [v[0] for v in VIOLATIONS]
# The strict validation policy, asked for by the request (the default is "report").
STRICT: dict[str, Any] = {"extra_body": {"tool_validation": "strict"}}


@pytest.mark.parametrize(("case", "text", "kwargs", "needles"), VIOLATIONS, ids=VIOLATION_IDS)
async def test_violation_streaming_ends_with_error_frame(
    edge: RunningEdge, case: str, text: str, kwargs: dict[str, Any], needles: list[str]
) -> None:
    """Streamed, strict: a call that breaks the declared tools or tool_choice ends the stream
    with a tool_validation_error frame naming the tool and the rule."""
    error = await stream_error(edge, model_output(text), **kwargs, **STRICT)
    assert error.type == "tool_validation_error"
    for needle in needles:
        assert needle in error.message


@pytest.mark.parametrize(("case", "text", "kwargs", "needles"), VIOLATIONS, ids=VIOLATION_IDS)
async def test_violation_non_streaming_is_422(
    edge: RunningEdge, case: str, text: str, kwargs: dict[str, Any], needles: list[str]
) -> None:
    """Not streamed, strict: the same violation is a 422 tool_validation_error response."""
    error = await create_error(edge, model_output(text), **kwargs, **STRICT)
    assert error.status_code == 422
    assert error.type == "tool_validation_error"
    # The error object's own message (the SDK's `message` quotes the body's repr).
    assert isinstance(error.body, dict)
    for needle in needles:
        assert needle in error.body["message"]


async def test_native_call_under_tool_choice_none_is_rejected(edge: RunningEdge) -> None:
    """tool_choice none holds for native calls too (strict)."""
    error = await stream_error(
        edge, model_output("", tool_calls=NATIVE), tool_choice="none", **STRICT
    )
    assert error.type == "tool_validation_error"
    assert 'tool_choice is "none" but the model called "get_weather"' in error.message


async def test_raw_sse_validation_error_frame(http: httpx.AsyncClient) -> None:
    """Strict: the error frame is the last frame: no tool_calls delta, no finish chunk, no [DONE];
    no markup was streamed before it."""
    text = "Sure.\n" + hermes("get_weather", {"city": 42})
    body = chat_body(
        "sim-script", model_output(text), tools=TOOLS, stream=True, tool_validation="strict"
    )
    response = await http.post(CHAT, json=body)
    assert response.status_code == 200
    payloads = parse_sse(response.content)
    assert "[DONE]" not in payloads
    frames = [json.loads(p) for p in payloads]
    error = frames[-1]["error"]
    assert error["type"] == "tool_validation_error"
    assert '"get_weather"' in error["message"]
    deltas = [f["choices"][0]["delta"] for f in frames[:-1]]
    assert all("tool_calls" not in d for d in deltas)
    assert all(f["choices"][0]["finish_reason"] is None for f in frames[:-1])
    assert "".join(d.get("content", "") for d in deltas) == "Sure."


DEEP = "[" * 5000 + "]" * 5000


async def test_json_nested_past_the_parser_depth_is_content(edge: RunningEdge) -> None:
    """A line-start JSON block nested deeper than the parser goes is not a call: it comes
    through as content and the stream finishes normally (no crash, no cut connection)."""
    chunks, final = await stream(edge, model_output(DEEP, big=True))
    assert streamed_content(chunks) == DEEP
    assert final.choices[0].finish_reason == "stop"
    completion = await create(edge, model_output(DEEP, big=True))
    assert completion.choices[0].message.content == DEEP


async def test_call_nested_past_the_parser_depth_is_a_validation_error(
    edge: RunningEdge,
) -> None:
    """A call whose arguments nest deeper than the parser goes cannot be read: one
    tool_validation_error (422 non-streaming), never a cut stream or a 500."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": ' + DEEP + "}}</tool_call>"
    error = await stream_error(edge, model_output(text, big=True))
    assert error.type == "tool_validation_error"
    assert "nested too deeply" in error.message
    status = await create_error(edge, model_output(text, big=True))
    assert status.status_code == 422
    native = await stream_error(edge, model_output("", tool_calls="[" + DEEP + "]"))
    assert native.type == "tool_validation_error"


# --- request-time validation --------------------------------------------------

BAD_TOOLS: list[tuple[str, dict[str, Any], str]] = [
    ("name", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ("type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "type"),
    ("function", {"tools": [{"type": "function"}]}, "function"),
    (
        "schema",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
        "parameters",
    ),
    ("duplicate", {"tools": [WEATHER, WEATHER]}, "name"),
    (
        "choice-undeclared",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ("required-without-tools", {"tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("stream_flag", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize(("case", "extra", "param"), BAD_TOOLS, ids=[b[0] for b in BAD_TOOLS])
async def test_bad_tools_are_400_before_any_run(
    edge: RunningEdge,
    http: httpx.AsyncClient,
    case: str,
    extra: dict[str, Any],
    param: str,
    stream_flag: bool,
) -> None:
    """A malformed tool definition or a tool_choice naming an undeclared tool is a 400
    invalid_request_error naming the field, before any run starts (the node sees nothing)."""
    body = chat_body("sim-script", model_output("hi"), stream=stream_flag, **extra)
    response = await http.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param in error["param"]
    assert edge.outcomes == [], "no run was started"
    assert not edge.edge.runs.live


# --- what is not a call ---------------------------------------------------------

PROSE = [
    (
        "tag-in-prose",
        "To call a tool, a model writes <tool_call> tags, like this: <tool_call> name "
        "</tool_call>. Mistral uses [TOOL_CALLS] instead.",
    ),
    ("config-json", 'Here is the config:\n{"temperature": 21, "unit": "celsius"}\nDone.'),
    ("mid-line-json", 'Pass {"name": "get_weather", "arguments": {}} to the API.'),
    ("python-code", 'Example:\n```python\ncall({"name": "get_weather"})\n```\nThat is all.'),
]


async def check_prose_is_content(edge: RunningEdge, text: str) -> None:
    """Text that mentions tool-call markup without making a call comes through intact,
    streamed and not, with finish_reason stop and no tool_calls."""
    chunks, final = await stream(edge, model_output(text))
    assert streamed_content(chunks) == text
    assert not tool_call_chunks(chunks)
    assert final.choices[0].finish_reason == "stop"
    completion = await create(edge, model_output(text))
    assert completion.choices[0].message.content == text
    assert completion.choices[0].message.tool_calls is None
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("case", "text"), PROSE, ids=[p[0] for p in PROSE])
async def test_prose_about_tool_calls_is_content(edge: RunningEdge, case: str, text: str) -> None:
    """Prose about tool calls is content with the default formats."""
    await check_prose_is_content(edge, text)


@pytest.mark.parametrize(("case", "text"), PROSE, ids=[p[0] for p in PROSE])
async def test_prose_about_tool_calls_is_content_with_every_format(
    formats_edge: RunningEdge, case: str, text: str
) -> None:
    """Prose about tool calls is content with bare and fenced JSON parsed too."""
    await check_prose_is_content(formats_edge, text)


EXPLAINER = (
    "Function calling works like this. The model answers with a call:\n"
    "```json\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "```\n"
    "or with a bare object on its own line:\n"
    '{"name": "search", "arguments": {"query": "weather"}}\n'
    "and your code runs the function and sends back the result."
)


async def test_call_examples_in_an_answer_are_content_by_default(edge: RunningEdge) -> None:
    """With the default formats (the tags), an answer that explains function calling with
    fenced and bare JSON examples, one naming a declared tool and one an undeclared one,
    streams through unchanged with tools declared: no call, no 422, finish_reason stop."""
    assert DEFAULT_FORMATS == ("hermes", "mistral", "llama")
    chunks, final = await stream(edge, model_output(EXPLAINER))
    assert streamed_content(chunks) == EXPLAINER
    assert not tool_call_chunks(chunks)
    assert final.choices[0].finish_reason == "stop"
    completion = await create(edge, model_output(EXPLAINER))
    assert completion.choices[0].message.content == EXPLAINER
    assert completion.choices[0].message.tool_calls is None
    assert completion.choices[0].finish_reason == "stop"


async def test_markup_without_declared_tools_is_content(edge: RunningEdge) -> None:
    """Without tools the tool-text filter is absent: markup is plain content."""
    text = hermes("get_weather", {"city": "Paris"})
    completion = await create(edge, model_output(text), tools=openai.NOT_GIVEN)
    assert completion.choices[0].message.content == text
    assert completion.choices[0].message.tool_calls is None


async def test_hold_back_releases_what_cannot_be_a_call_at_once(http: httpx.AsyncClient) -> None:
    """While streaming, text that cannot start a call is sent as it arrives; only a possible
    call start (here `<tool_`, with the space before it) is held. A run that then fails shows
    that: the released text reached the caller before the error frame, the held part never."""
    body = chat_body(
        "sim-script",
        script(
            *(
                {"type": "delta", "delta": piece}
                for piece in ["Sunny in ", "Paris.", " See <tool_"]
            ),
            {"type": "error", "error": "the model crashed"},
        ),
        tools=TOOLS,
        stream=True,
    )
    response = await http.post(CHAT, json=body)
    frames = [json.loads(p) for p in parse_sse(response.content)]
    assert frames[-1]["error"]["type"] == "run_error"
    deltas = [f["choices"][0]["delta"] for f in frames[:-1]]
    # Trailing whitespace waits for the next delta (it would go if a call followed).
    assert [d["content"] for d in deltas if "content" in d] == ["Sunny in", " Paris.", " See"]


async def test_hold_back_cap_releases_text_as_content(http: httpx.AsyncClient) -> None:
    """More than 64 KiB held after a candidate start is released as content while the run is
    still going: it reaches the caller before the run's error frame."""
    body = chat_body(
        "sim-script",
        script(
            {"type": "delta", "delta": "Note: <tool_call>"},
            {"type": "delta", "delta": "x" * 1024, "repeat": 65},
            {"type": "error", "error": "the model crashed"},
        ),
        tools=TOOLS,
        stream=True,
    )
    response = await http.post(CHAT, json=body)
    frames = [json.loads(p) for p in parse_sse(response.content)]
    assert frames[-1]["error"]["message"] == "the model crashed"
    content = "".join(f["choices"][0]["delta"].get("content", "") for f in frames[:-1])
    assert content.startswith("Note: <tool_call>xxx")
    assert len(content) > 64 * 1024


async def test_per_model_formats(nursery: trio.Nursery, sim: SimProcess) -> None:
    """[models.NAME] tool_call_formats limits the parsed formats: with only "hermes", a bare
    JSON call is content, while a Hermes call is still a call."""
    config = replace(
        edge_config(sim),
        models={"sim-script": ModelConfig(reasoning_parser="think", tool_call_formats=("hermes",))},
    )
    running = await start_edge(nursery, config)
    try:
        bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
        completion = await create(running, model_output(bare))
        assert completion.choices[0].message.content == bare
        assert completion.choices[0].finish_reason == "stop"
        completion = await create(running, model_output(hermes("get_weather", PARIS)))
        assert calls_of(completion.choices[0].message.tool_calls) == [("get_weather", PARIS)]
    finally:
        await stop_edge(running)


# --- the conversation around calls ------------------------------------------------


async def test_tool_results_in_the_conversation(edge: RunningEdge) -> None:
    """A request carrying an assistant tool_calls message and its tool result is accepted and
    answered (what reaches the node is checked in tests/unit/test_convert.py)."""

    def call() -> Any:
        with _sdk(edge) as client:
            return client.chat.completions.create(
                model="sim-script",
                tools=TOOLS,
                messages=[
                    {"role": "user", "content": "Weather in Paris?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city":"P"}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
                    {"role": "user", "content": model_output("It is 21 degrees in Paris.")},
                ],
            )

    completion = await trio.to_thread.run_sync(call)
    assert completion.choices[0].message.content == "It is 21 degrees in Paris."
    assert completion.choices[0].finish_reason == "stop"
