"""Tests of chat completions request parsing: every field's good and bad values."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.api.request import (
    TOO_DEEP,
    TOO_MANY_VALUES,
    ChatMessage,
    ChatRequest,
    ContentPart,
    check_json_bounds,
    parse_chat_request,
)
from edge.errors import RequestError
from edge.stream import bounds
from edge.stream.toolcall import ToolCall, ToolChoice, ToolPolicy

USER = {"role": "user", "content": "hi"}
NO_TOOLS = ToolChoice(mode="none")  # OpenAI's default tool_choice without tools
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def body(**fields: Any) -> bytes:
    """A minimal valid request with `fields` merged in; a value of ... drops the field."""
    obj: dict[str, Any] = {"model": "m", "messages": [USER]}
    obj.update(fields)
    return json.dumps({k: v for k, v in obj.items() if v is not ...}).encode()


def parse(**fields: Any) -> ChatRequest:
    return parse_chat_request(body(**fields))


def reject(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_chat_request(raw)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


# --- the minimal request and defaults -----------------------------------------


def test_minimal_request_gets_the_defaults() -> None:
    """A request with only model and one user message parses, every option at its default."""
    req = parse_chat_request(b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
    assert req.model == "m"
    assert req.messages == (ChatMessage(role="user", content="hi"),)
    assert req.stream is False
    assert req.include_usage is False
    assert req.tools == ToolPolicy(choice=ToolChoice(mode="none"))
    assert req.tools.parallel_tool_calls is True
    assert (req.temperature, req.top_p, req.max_tokens, req.seed) == (None, None, None, None)
    assert req.stop == ()
    assert req.metadata == {}
    assert req.extra == {}
    assert (req.include_reasoning, req.reasoning_explicit, req.reasoning_effort) == (
        True,
        False,
        None,
    )
    assert (req.strict_output, req.stream_buffer, req.trace_stream) == (None, None, False)
    assert req.tool_validation is None


# --- every field: good values --------------------------------------------------

GOOD: list[tuple[dict[str, Any], str, object]] = [
    # fields, ChatRequest attribute, expected value
    ({"stream": True}, "stream", True),
    ({"stream": False}, "stream", False),
    ({"stream": None}, "stream", False),
    ({"stream": True, "stream_options": {"include_usage": True}}, "include_usage", True),
    ({"stream": True, "stream_options": {"include_usage": False}}, "include_usage", False),
    ({"stream": True, "stream_options": {}}, "include_usage", False),
    ({"temperature": 0}, "temperature", 0.0),
    ({"temperature": 2}, "temperature", 2.0),
    ({"temperature": 0.7}, "temperature", 0.7),
    ({"temperature": None}, "temperature", None),
    ({"top_p": 1}, "top_p", 1.0),
    ({"top_p": 0.01}, "top_p", 0.01),
    ({"max_tokens": 1}, "max_tokens", 1),
    ({"max_tokens": 4096}, "max_tokens", 4096),
    ({"max_completion_tokens": 7}, "max_tokens", 7),
    ({"max_tokens": 5, "max_completion_tokens": 9}, "max_tokens", 9),
    ({"max_tokens": 5, "max_completion_tokens": None}, "max_tokens", 5),
    ({"n": 1}, "stream", False),
    ({"n": None}, "stream", False),
    ({"stop": "END"}, "stop", ("END",)),
    ({"stop": ["a", "b", "c", "d"]}, "stop", ("a", "b", "c", "d")),
    ({"stop": []}, "stop", ()),
    ({"stop": None}, "stop", ()),
    ({"seed": 42}, "seed", 42),
    ({"seed": -1}, "seed", -1),
    ({"presence_penalty": -2}, "presence_penalty", -2.0),
    ({"presence_penalty": 2}, "presence_penalty", 2.0),
    ({"frequency_penalty": 0.5}, "frequency_penalty", 0.5),
    ({"response_format": {"type": "text"}}, "response_format", {"type": "text"}),
    ({"response_format": {"type": "json_object"}}, "response_format", {"type": "json_object"}),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    ),
    ({"metadata": {"a": "1"}}, "metadata", {"a": "1"}),
    (
        {"metadata": {f"k{i}": "v" for i in range(16)}},
        "metadata",
        {f"k{i}": "v" for i in range(16)},
    ),
    ({"metadata": None}, "metadata", {}),
    ({"metadata": {"trace_stream": "1"}}, "trace_stream", True),
    ({"metadata": {"trace_stream": "true"}}, "trace_stream", True),
    ({"metadata": {"trace_stream": "yes"}}, "trace_stream", True),
    ({"metadata": {"trace_stream": "0"}}, "trace_stream", False),
    ({"metadata": {"trace_stream": "no"}}, "trace_stream", False),
    ({"user": "u-1"}, "user", "u-1"),
    ({"prompt_cache_key": "conversation-7"}, "prompt_cache_key", "conversation-7"),
    ({"prompt_cache_key": ""}, "prompt_cache_key", None),
    ({"reasoning_effort": "minimal"}, "reasoning_effort", "minimal"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "high"),
    ({"strict_output": True}, "strict_output", True),
    ({"strict_output": False}, "strict_output", False),
    ({"stream_buffer": True}, "stream_buffer", True),
    ({"stream_buffer": False}, "stream_buffer", False),
    ({"tool_validation": "strict"}, "tool_validation", "strict"),
    ({"tool_validation": "report"}, "tool_validation", "report"),
    ({"tool_validation": "off"}, "tool_validation", "off"),
    ({"tool_validation": None}, "tool_validation", None),
    (
        {"parallel_tool_calls": False},
        "tools",
        ToolPolicy(choice=NO_TOOLS, parallel_tool_calls=False),
    ),
    ({"tools": []}, "tools", ToolPolicy(choice=NO_TOOLS)),
    ({"tools": None}, "tools", ToolPolicy(choice=NO_TOOLS)),
    ({"tool_choice": None}, "tools", ToolPolicy(choice=NO_TOOLS)),
    ({"tool_choice": "none"}, "tools", ToolPolicy(choice=ToolChoice(mode="none"))),
    ({"tool_choice": "auto"}, "tools", ToolPolicy(choice=ToolChoice(mode="auto"))),
    ({"tools": [], "tool_choice": "none"}, "tools", ToolPolicy(choice=ToolChoice(mode="none"))),
]


@pytest.mark.parametrize(("fields", "attr", "expected"), GOOD, ids=lambda v: repr(v)[:60])
def test_good_field_values_are_accepted(
    fields: dict[str, Any], attr: str, expected: object
) -> None:
    """Each valid value of each field parses, and lands on the ChatRequest as documented."""
    assert getattr(parse(**fields), attr) == expected


# --- every field: bad values ---------------------------------------------------

BAD: list[tuple[dict[str, Any], str | None]] = [
    # fields, the expected `param`
    ({"model": ...}, "model"),
    ({"model": ""}, "model"),
    ({"model": 3}, "model"),
    ({"model": None}, "model"),
    ({"messages": ...}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": {}}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [1]}, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": 1, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "system"}]}, "messages[0].content"),
    ({"messages": [USER, {"role": "user", "content": 5}]}, "messages[1].content"),
    ({"messages": [USER, {"role": "user", "content": {"a": 1}}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": [1]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        "messages[0].content[0].text",
    ),
    ({"messages": [{"role": "user", "content": "x", "name": 1}]}, "messages[0].name"),
    ({"messages": [USER, {"role": "assistant"}]}, "messages[1].content"),
    ({"messages": [USER, {"role": "assistant", "content": None}]}, "messages[1].content"),
    (
        {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": []}]},
        "messages[1].content",
    ),
    ({"messages": [USER, {"role": "tool", "content": "42"}]}, "messages[1].tool_call_id"),
    ({"messages": [USER, {"role": "tool", "tool_call_id": "c1"}]}, "messages[1].content"),
    ({"messages": [USER, {"role": "function", "content": "42"}]}, "messages[1].name"),
    (
        {"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        "messages[1].tool_calls[0].function",
    ),
    (
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "x", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
            ]
        },
        "messages[1].tool_calls[0].type",
    ),
    (
        {"messages": [USER, {"role": "assistant", "content": "x", "reasoning_content": 1}]},
        "messages[1].reasoning_content",
    ),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -1}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 2**32}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 1.0}, "max_completion_tokens"),
    ({"n": 2}, "n"),
    ({"n": 0}, "n"),
    ({"n": "1"}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", 1]}, "stop[1]"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
        "response_format.json_schema.schema",
    ),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"a": 1}}, "metadata"),
    ({"metadata": ["a"]}, "metadata"),
    ({"user": 5}, "user"),
    ({"include_reasoning": "yes"}, "include_reasoning"),
    ({"reasoning": True}, "reasoning"),
    ({"reasoning": {"exclude": "no"}}, "reasoning.exclude"),
    ({"reasoning": {"enabled": 1}}, "reasoning.enabled"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"reasoning_effort": "maximum"}, "reasoning_effort"),
    ({"reasoning_effort": 1}, "reasoning_effort"),
    ({"strict_output": "true"}, "strict_output"),
    ({"stream_buffer": 0}, "stream_buffer"),
    ({"tool_validation": "lenient"}, "tool_validation"),
    ({"tool_validation": "STRICT"}, "tool_validation"),
    ({"tool_validation": ""}, "tool_validation"),
    ({"tool_validation": True}, "tool_validation"),
    ({"tool_validation": ["strict"]}, "tool_validation"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": {}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tool_choice": 1}, "tool_choice"),
    ({"top_k": "5"}, "top_k"),
    ({"min_p": "0.1"}, "min_p"),
    ({"logit_bias": {"50256": "x"}}, "logit_bias"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "logprobs"),
    ({"logprobs": False, "top_logprobs": 1}, "logprobs"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=lambda v: repr(v)[:60])
def test_bad_field_values_are_400_naming_the_param(
    fields: dict[str, Any], param: str | None
) -> None:
    """Each invalid value is a 400 invalid_request_error whose `param` names the field."""
    err = reject(body(**fields))
    assert err.param == param
    assert err.message
    assert "`$" not in err.message  # msgspec's raw path never leaks


def test_n_above_one_says_only_one_is_supported() -> None:
    """n>1 is refused with a message saying only n=1 is supported."""
    assert "only n=1 is supported" in reject(body(n=3)).message.lower()


def test_type_error_message_names_the_path_and_types() -> None:
    """A type error at depth names the field, what was expected and what was sent."""
    err = reject(body(messages=[USER, {"role": "user", "content": 5}]))
    assert err.message == (
        "Invalid type for 'messages[1].content': expected one of a string, an array or null, "
        "but got an integer instead."
    )


def test_missing_field_message() -> None:
    """A missing required field is reported as OpenAI does: 'Missing required parameter'."""
    assert reject(body(messages=...)).message == "Missing required parameter: 'messages'."


# --- bodies that are not a JSON object -----------------------------------------


@pytest.mark.parametrize(
    "raw",
    [b"", b" ", b"{", b"not json", b'{"model": "m",}', b"\xff\xfe", b'{"model":"m"} x', b"NaN"],
)
def test_malformed_json_is_400_without_param(raw: bytes) -> None:
    """A body that is not JSON is a 400 that says the JSON could not be parsed; no param."""
    err = reject(raw)
    assert err.message.startswith("We could not parse the JSON body of your request.")
    assert err.param is None
    assert err.code is None


@pytest.mark.parametrize("raw", [b"[]", b'[{"model":"m"}]', b"1", b'"s"', b"null", b"true"])
def test_json_that_is_not_an_object_is_400(raw: bytes) -> None:
    """A JSON body that is not an object is a 400 that says so; no param."""
    err = reject(raw)
    assert err.message.startswith("The request body must be a JSON object")
    assert err.param is None


# --- messages ------------------------------------------------------------------


def test_roles_and_optional_message_fields() -> None:
    """Every role parses; name and tool_call_id pass through; reasoning only on assistants."""
    req = parse(
        messages=[
            {"role": "system", "content": "s"},
            {"role": "developer", "content": "d"},
            {"role": "user", "content": "", "name": "ann"},
            {"role": "assistant", "content": "a", "reasoning_content": "r1"},
            {"role": "assistant", "content": "b", "reasoning": "r2"},
            {"role": "assistant", "content": "c", "reasoning_content": "r3", "reasoning": "x"},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
            {"role": "function", "content": "7", "name": "f"},
            {"role": "user", "content": "u", "reasoning_content": "ignored"},
        ]
    )
    assert req.messages == (
        ChatMessage(role="system", content="s"),
        ChatMessage(role="developer", content="d"),
        ChatMessage(role="user", content="", name="ann"),
        ChatMessage(role="assistant", content="a", reasoning_content="r1"),
        ChatMessage(role="assistant", content="b", reasoning_content="r2"),
        ChatMessage(role="assistant", content="c", reasoning_content="r3"),
        ChatMessage(role="tool", content="42", tool_call_id="call_1"),
        ChatMessage(role="function", content="7", name="f"),
        ChatMessage(role="user", content="u"),
    )


def test_assistant_tool_calls_pass_through() -> None:
    """An assistant's tool_calls become ToolCalls, arguments kept as the exact string."""
    args = '{"city": "Paris",  "unit": "c"}'
    req = parse(
        messages=[
            USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "w", "arguments": args},
                    },
                    {"id": "call_2", "function": {"name": "v", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    assistant = req.messages[1]
    assert assistant.content is None
    assert assistant.tool_calls == (
        ToolCall(id="call_1", name="w", arguments=args),
        ToolCall(id="call_2", name="v", arguments=""),
    )
    assert req.messages[2].tool_call_id == "call_1"


def test_content_parts_keep_text_and_raw() -> None:
    """Array content becomes parts: text parts carry their text, every part its raw dict."""
    image = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AAA", "detail": "low"},
    }
    text = {"type": "text", "text": "What is this?"}
    req = parse(messages=[{"role": "user", "content": [text, image]}])
    message = req.messages[0]
    assert message.content is None
    assert message.parts == (
        ContentPart(type="text", text="What is this?", raw=text),
        ContentPart(type="image_url", text="", raw=image),
    )


# --- reasoning flags -------------------------------------------------------------

REASONING: list[tuple[dict[str, Any], bool, bool]] = [
    # fields, include_reasoning, reasoning_explicit
    ({}, True, False),
    ({"include_reasoning": None}, True, False),
    ({"include_reasoning": True}, True, True),
    ({"include_reasoning": False}, False, False),
    ({"reasoning": {}}, True, False),
    ({"reasoning": None}, True, False),
    ({"reasoning": {"exclude": True}}, False, False),
    ({"reasoning": {"exclude": False}}, True, True),
    ({"reasoning": {"enabled": True}}, True, True),
    ({"reasoning": {"enabled": False}}, False, False),
    ({"reasoning": {"effort": "high"}}, True, False),
    ({"reasoning": {"enabled": True, "exclude": True}}, False, True),
    ({"reasoning": {"enabled": False, "exclude": False}}, False, True),
    ({"include_reasoning": True, "reasoning": {"exclude": True}}, False, True),
    ({"include_reasoning": False, "reasoning": {"exclude": False}}, False, True),
    ({"include_reasoning": False, "reasoning": {"enabled": True}}, False, True),
    ({"include_reasoning": True, "reasoning": {"enabled": True}}, True, True),
]


@pytest.mark.parametrize(("fields", "include", "explicit"), REASONING, ids=repr)
def test_reasoning_flag_resolution(fields: dict[str, Any], include: bool, explicit: bool) -> None:
    """include_reasoning is on unless turned off; explicit when asked for in so many words."""
    req = parse(**fields)
    assert (req.include_reasoning, req.reasoning_explicit) == (include, explicit)


# --- lenient and pass-through fields ---------------------------------------------


def test_unknown_fields_are_ignored() -> None:
    """Unknown top-level and message fields are ignored, not an error (vLLM leniency)."""
    req = parse(
        messages=[{"role": "user", "content": "hi", "weird": [1, {"x": None}]}],
        frobnicate=True,
        service_tier="auto",
        store=False,
    )
    assert req == parse()


def test_extras_are_captured_untouched() -> None:
    """The known sampling extensions pass to `extra` as sent; absent or null ones do not."""
    extras = {
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1,
        "logit_bias": {"50256": -100},
        "logprobs": True,
        "top_logprobs": 3,
        "ignore_eos": False,
        "min_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False, "nested": {"a": [1]}},
    }
    assert parse(**extras).extra == extras
    assert parse(top_k=-1, min_p=None).extra == {"top_k": -1}
    assert type(parse(repetition_penalty=1).extra["repetition_penalty"]) is int


# --- tools -----------------------------------------------------------------------


def test_declared_tools_become_a_policy() -> None:
    """Declared tools become ToolSpecs; tool_choice and parallel_tool_calls are resolved."""
    req = parse(tools=[WEATHER_TOOL], parallel_tool_calls=False)
    assert [t.name for t in req.tools.tools] == ["get_weather"]
    assert req.tools.choice == ToolChoice(mode="auto")
    assert req.tools.parallel_tool_calls is False
    assert parse(tools=[WEATHER_TOOL], tool_choice="required").tools.choice.mode == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert parse(tools=[WEATHER_TOOL], tool_choice=named).tools.choice == ToolChoice(
        mode="function", name="get_weather"
    )


@pytest.mark.parametrize(
    ("fields", "prefix"),
    [
        ({"tools": [1]}, "tools[0]"),
        ({"tools": [WEATHER_TOOL, {"type": "function"}]}, "tools[1]"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice",
        ),
    ],
    ids=repr,
)
def test_bad_tools_are_400(fields: dict[str, Any], prefix: str) -> None:
    """A malformed or duplicate tool, or a bad tool_choice, is a 400 whose param points at it."""
    err = reject(body(**fields))
    assert err.param is not None
    assert err.param.startswith(prefix)


# --- robustness ------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def requests(noise: bool) -> st.SearchStrategy[dict[str, Any]]:
    """Request-shaped objects: every known field, at every depth, holds a plausible value
    (valid, or just out of range); with `noise`, sometimes arbitrary JSON instead."""

    def near(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(valid, valid, valid, JSON) if noise else valid

    def shaped(required: dict[str, Any], **optional: st.SearchStrategy[Any]) -> Any:
        optional = {k: near(v) for k, v in optional.items()}
        return near(st.fixed_dictionaries(required, optional=optional))

    short = st.text(max_size=3)
    part = shaped({"type": near(st.sampled_from(["text", "image_url"]))}, text=short, x=JSON)
    call = shaped(
        {"id": short, "function": shaped({"name": short, "arguments": near(short)})},
        type=st.sampled_from(["function", "x"]),
    )
    tool = shaped(
        {
            "type": st.just("function"),
            "function": shaped(
                {"name": st.sampled_from(["f", "g"])},
                description=short,
                parameters=st.just({"type": "object"}) | JSON,
                strict=st.booleans(),
            ),
        }
    )
    message = shaped(
        {
            "role": near(st.sampled_from(["user", "assistant", "tool", "function", "x"])),
            "content": near(st.text() | st.lists(part, max_size=3) | st.none()),
        },
        name=short,
        tool_call_id=short,
        tool_calls=st.lists(call, max_size=2),
        reasoning_content=short,
        reasoning=short,
    )
    fields: dict[str, st.SearchStrategy[Any]] = {
        "stream": st.booleans(),
        "stream_options": shaped({}, include_usage=st.booleans()),
        "tools": st.lists(tool, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required", "x"])
        | shaped({"type": st.just("function"), "function": shaped({"name": st.just("f")})}),
        "parallel_tool_calls": st.booleans(),
        "temperature": st.floats(-0.1, 2.1),
        "top_p": st.floats(0, 1.1),
        "max_tokens": st.integers(0, 2**32),
        "max_completion_tokens": st.integers(0, 2**32),
        "n": st.integers(1, 2),
        "stop": st.text() | st.lists(st.text(), max_size=5),
        "seed": st.integers(-(2**64), 2**64),
        "presence_penalty": st.floats(-2.1, 2.1),
        "frequency_penalty": st.floats(-2.1, 2.1),
        "response_format": shaped(
            {"type": st.sampled_from(["text", "json_schema", "x"])},
            json_schema=shaped({}, name=short, schema=JSON),
        ),
        "metadata": st.dictionaries(short, short, max_size=17),
        "user": short,
        "include_reasoning": st.booleans(),
        "reasoning": shaped({}, exclude=st.booleans(), enabled=st.booleans(), effort=short),
        "reasoning_effort": st.sampled_from(["low", "max"]),
        "strict_output": st.booleans(),
        "stream_buffer": st.booleans(),
        "tool_validation": st.sampled_from(["strict", "report", "off", "x"]),
        "top_k": st.integers(),
        "logit_bias": st.dictionaries(short, st.floats(allow_nan=False, allow_infinity=False)),
        "chat_template_kwargs": st.dictionaries(short, JSON),
    }
    return st.fixed_dictionaries(
        {"model": near(st.just("m")), "messages": near(st.lists(message, min_size=1, max_size=3))},
        optional={name: near(strategy) for name, strategy in fields.items()},
    )


def check_total(raw: bytes) -> None:
    try:
        result: object = parse_chat_request(raw)
    except RequestError as err:
        result = err
    if isinstance(result, RequestError):
        assert (result.status, bool(result.message)) == (400, True)
    else:
        assert isinstance(result, ChatRequest)


@given(JSON)
def test_any_json_body_parses_or_is_a_request_error(value: object) -> None:
    """For any JSON body, parsing returns a ChatRequest or raises RequestError, nothing else."""
    check_total(json.dumps(value).encode())


@given(requests(noise=True) | requests(noise=False))
def test_any_request_shaped_body_parses_or_is_a_request_error(value: dict[str, Any]) -> None:
    """Objects with near-valid known fields give a ChatRequest or RequestError, nothing else."""
    check_total(json.dumps(value).encode())


@given(st.binary(max_size=64))
def test_any_bytes_parse_or_are_a_request_error(raw: bytes) -> None:
    """Arbitrary bytes give a ChatRequest or RequestError, nothing else."""
    check_total(raw)


def test_reasoning_effort_from_either_form() -> None:
    """`reasoning_effort` comes from the top-level field, else from `reasoning.effort`;
    a bad `reasoning.effort` is a 400 like a bad top-level one."""
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    both = {**base, "reasoning_effort": "low", "reasoning": {"effort": "high"}}
    assert parse_chat_request(json.dumps(both).encode()).reasoning_effort == "low"
    nested = {**base, "reasoning": {"effort": "high"}}
    assert parse_chat_request(json.dumps(nested).encode()).reasoning_effort == "high"
    with pytest.raises(RequestError) as info:
        parse_chat_request(json.dumps({**base, "reasoning": {"effort": "max"}}).encode())
    assert info.value.param == "reasoning.effort"


# --- limits: each a 400 naming the parameter, the limit and its value ---------------

DEEP_SCHEMA: dict[str, Any] = {}
for _ in range(bounds.MAX_SCHEMA_DEPTH):
    DEEP_SCHEMA = {"not": DEEP_SCHEMA}
ASSISTANT_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("fields", "param", "limit"),
    [
        ({"messages": [USER] * (bounds.MAX_MESSAGES + 1)}, "messages", bounds.MAX_MESSAGES),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 1025}]},
            "messages[0].content",
            bounds.MAX_CONTENT_PARTS,
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [ASSISTANT_CALL] * 1025}]},
            "messages[0].tool_calls",
            bounds.MAX_MESSAGE_TOOL_CALLS,
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                **ASSISTANT_CALL,
                                "function": {
                                    "name": "f",
                                    "arguments": "x" * (bounds.MAX_TOOL_ARGUMENTS_CHARS + 1),
                                },
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
            bounds.MAX_TOOL_ARGUMENTS_CHARS,
        ),
        ({"tools": [WEATHER_TOOL] * (bounds.MAX_TOOLS + 1)}, "tools", bounds.MAX_TOOLS),
        ({"stop": "x" * (bounds.MAX_STOP_CHARS + 1)}, "stop", bounds.MAX_STOP_CHARS),
        ({"stop": ["a", "x" * (bounds.MAX_STOP_CHARS + 1)]}, "stop", bounds.MAX_STOP_CHARS),
        (
            {"metadata": {"k" * 65: "v"}},
            "metadata",
            bounds.MAX_METADATA_KEY_CHARS,
        ),
        (
            {"metadata": {"k": "v" * 513}},
            "metadata.k",
            bounds.MAX_METADATA_VALUE_CHARS,
        ),
        ({"user": "u" * (bounds.MAX_USER_CHARS + 1)}, "user", bounds.MAX_USER_CHARS),
        (
            {"prompt_cache_key": "k" * (bounds.MAX_USER_CHARS + 1)},
            "prompt_cache_key",
            bounds.MAX_USER_CHARS,
        ),
        ({"model": "m" * (bounds.MAX_MODEL_CHARS + 1)}, "model", bounds.MAX_MODEL_CHARS),
        (
            {"logit_bias": {str(i): 1 for i in range(bounds.MAX_LOGIT_BIAS + 1)}},
            "logit_bias",
            bounds.MAX_LOGIT_BIAS,
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "schema": {"properties": {f"p{i}": {} for i in range(5000)}},
                    },
                }
            },
            "response_format.json_schema.schema",
            bounds.MAX_SCHEMA_BYTES,
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": DEEP_SCHEMA},
                }
            },
            "response_format.json_schema.schema",
            bounds.MAX_SCHEMA_DEPTH,
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_limits_are_400_naming_param_and_limit(
    fields: dict[str, Any], param: str, limit: int
) -> None:
    """Each bound on what a request asks of the edge answers with a 400 whose param
    is the offending field and whose message gives the limit's value."""
    error = reject(body(**fields))
    assert error.status == 400
    assert error.param == param
    assert str(limit) in str(error)


def test_limits_allow_their_own_value() -> None:
    """A request exactly at the limits is accepted."""
    request = parse(
        stop=["x" * bounds.MAX_STOP_CHARS] * bounds.MAX_STOP,
        metadata={"k" * bounds.MAX_METADATA_KEY_CHARS: "v" * bounds.MAX_METADATA_VALUE_CHARS},
        user="u" * bounds.MAX_USER_CHARS,
        tools=[
            {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "name": f"t{i}"}}
            for i in range(bounds.MAX_TOOLS)
        ],
    )
    assert len(request.tools.tools) == bounds.MAX_TOOLS


def test_logprobs_flag() -> None:
    """`logprobs: true` sets the request's flag (top_logprobs 0-20 with it, or 0 without);
    both still reach the node as sent."""
    assert parse_chat_request(body()).logprobs is False
    asked = parse_chat_request(body(logprobs=True, top_logprobs=20))
    assert asked.logprobs is True
    assert asked.extra == {"logprobs": True, "top_logprobs": 20}
    assert parse_chat_request(body(top_logprobs=0)).logprobs is False


# --- the body's JSON bounds ----------------------------------------------------------


def _nested(levels: int) -> Any:
    """`levels` arrays, each the only element of the one around it: `[[...[]...]]`."""
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_json_depth_is_bounded_exactly() -> None:
    """A body MAX_JSON_DEPTH levels deep passes the bound; one level more is a 400 naming
    the limit, whichever field holds it."""
    check_json_bounds(_nested(bounds.MAX_JSON_DEPTH))
    with pytest.raises(RequestError) as raised:
        check_json_bounds(_nested(bounds.MAX_JSON_DEPTH + 1))
    assert raised.value.message == TOO_DEEP
    assert str(bounds.MAX_JSON_DEPTH) in TOO_DEEP
    # body (1) > chat_template_kwargs (2) > the array: 62 more levels fit, 63 do not.
    extra = {"chat_template_kwargs": {"x": _nested(bounds.MAX_JSON_DEPTH - 2)}}
    assert parse(**extra).extra["chat_template_kwargs"] == extra["chat_template_kwargs"]
    assert reject(body(chat_template_kwargs={"x": _nested(63)})).message == TOO_DEEP


def test_json_values_are_bounded_exactly() -> None:
    """Array elements and object members count at every depth: exactly MAX_JSON_VALUES
    pass, one more is a 400 naming the limit."""
    half = bounds.MAX_JSON_VALUES // 2
    check_json_bounds({"a": [0] * (half - 2), "b": {str(i): None for i in range(half)}})
    with pytest.raises(RequestError) as raised:
        check_json_bounds({"a": [0] * (half - 1), "b": {str(i): None for i in range(half)}})
    assert raised.value.message == TOO_MANY_VALUES
    assert str(bounds.MAX_JSON_VALUES) in TOO_MANY_VALUES


def test_many_tiny_content_parts_are_refused_by_the_value_bound() -> None:
    """Content parts under every per-message limit, but hundreds of thousands in all
    (each a value for every later step), are refused before any field is read."""
    parts = [{"type": ""}] * bounds.MAX_CONTENT_PARTS
    messages = [{"role": "user", "content": parts}] * 320
    assert reject(body(messages=messages)).message == TOO_MANY_VALUES


def test_a_scalar_or_shallow_body_is_not_walked_into() -> None:
    """Scalars, empty and shallow containers are within the bounds."""
    check_json_bounds(3)
    check_json_bounds("x" * 100)
    check_json_bounds({})
    check_json_bounds([{"a": [1, {"b": None}]}])
