"""Tests of tool definitions, native normalization, synthesis and call validation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge.api.render import tool_calls_list
from edge.errors import RequestError
from edge.stream.toolcall import ToolCall, ToolChoice, ToolPolicy, ToolSpec
from edge.stream.toolparse import FORMATS
from edge.stream.tools import (
    parse_native_tool_calls,
    synthesize_tool_calls,
    unstreamed_remainder,
    validate_tool_calls,
    validate_tool_choice,
    validate_tool_definition,
    validate_tools,
)

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = ToolSpec("get_weather", "Current weather", WEATHER_SCHEMA)
TIME = ToolSpec("get_time")
POLICY = ToolPolicy(tools=(WEATHER, TIME))


def fn(name: str, **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **extra}}


def call(name: str, arguments: str = "{}", id_: str = "call_1") -> ToolCall:
    return ToolCall(id=id_, name=name, arguments=arguments)


# --- tool definitions and tool_choice ----------------------------------------------


def test_valid_definition() -> None:
    """A well-formed definition becomes a ToolSpec carrying every field."""
    spec = validate_tool_definition(
        fn("get_weather", description="d", parameters=WEATHER_SCHEMA, strict=True), 0
    )
    assert spec == ToolSpec("get_weather", "d", WEATHER_SCHEMA, True)
    assert validate_tool_definition(fn("a-b_9"), 3) == ToolSpec("a-b_9")


@pytest.mark.parametrize(
    ("obj", "param", "message"),
    [
        ([], "tools[2]", "must be an object"),
        ({"type": "retrieval"}, "tools[2].type", '"function"'),
        ({"type": "function"}, "tools[2].function", "must be an object"),
        (fn("has space"), "tools[2].function.name", "must match"),
        (fn("x" * 65), "tools[2].function.name", "must match"),
        (fn("ok\n"), "tools[2].function.name", "must match"),
        (fn(""), "tools[2].function.name", "must match"),
        ({"type": "function", "function": {}}, "tools[2].function.name", "must match"),
        (fn("f", description=3), "tools[2].function.description", "string"),
        (fn("f", parameters=[]), "tools[2].function.parameters", "JSON Schema object"),
        (
            fn("f", parameters={"type": "objekt"}),
            "tools[2].function.parameters",
            "is not a valid JSON Schema: 'objekt' is not valid",
        ),
        (
            fn("f", parameters={"type": "object", "required": "city"}),
            "tools[2].function.parameters",
            "(at $.required)",
        ),
        (fn("f", strict="yes"), "tools[2].function.strict", "boolean"),
    ],
)
def test_malformed_definitions(obj: object, param: str, message: str) -> None:
    """Each malformed definition is a RequestError whose param points at the bad field."""
    with pytest.raises(RequestError) as info:
        validate_tool_definition(obj, 2)
    assert info.value.param == param
    assert message in info.value.message


def test_duplicate_tool_names() -> None:
    """Two tools with one name are refused, naming the second."""
    with pytest.raises(RequestError) as info:
        validate_tools([fn("a"), fn("b"), fn("a")])
    assert info.value.param == "tools[2].function.name"
    with pytest.raises(RequestError, match="array"):
        validate_tools({"a": 1})
    assert validate_tools([fn("a"), fn("b")]) == (ToolSpec("a"), ToolSpec("b"))


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (None, ToolChoice("auto")),
        ("none", ToolChoice("none")),
        ("auto", ToolChoice("auto")),
        ("required", ToolChoice("required")),
        (fn("get_time"), ToolChoice("function", "get_time")),
    ],
)
def test_valid_tool_choice(obj: object, expected: ToolChoice) -> None:
    """Every accepted tool_choice form maps to its ToolChoice."""
    assert validate_tool_choice(obj, POLICY.tools) == expected


@pytest.mark.parametrize(
    ("obj", "tools"),
    [
        ("always", POLICY.tools),
        (3, POLICY.tools),
        ({"type": "function"}, POLICY.tools),
        ({"type": "tool", "function": {"name": "get_time"}}, POLICY.tools),
        (fn("nope"), POLICY.tools),
        ("required", ()),
    ],
)
def test_bad_tool_choice(obj: object, tools: tuple[ToolSpec, ...]) -> None:
    """A bad tool_choice, or a named function that was not declared, is a RequestError."""
    with pytest.raises(RequestError) as info:
        validate_tool_choice(obj, tools)
    assert info.value.param == "tool_choice"


def test_tool_choice_default_without_tools() -> None:
    """With no tools, an absent tool_choice means "none"."""
    assert validate_tool_choice(None, ()) == ToolChoice("none")


# --- native tool calls -------------------------------------------------------------


def native(entries: object, policy: ToolPolicy = POLICY) -> tuple[ToolCall, ...]:
    return parse_native_tool_calls(json.dumps(entries), policy, "run1").calls


def test_native_missing_and_duplicate_ids() -> None:
    """Missing, empty and repeated ids become call_{prefix}_{index}; given ids are kept."""
    calls = native(
        [
            {"id": "a", "function": {"name": "get_time", "arguments": "{}"}},
            {"function": {"name": "get_time", "arguments": "{}"}},
            {"id": "a", "function": {"name": "get_time", "arguments": "{}"}},
            {"id": "", "function": {"name": "get_time", "arguments": "{}"}},
        ]
    )
    assert [c.id for c in calls] == ["a", "call_run1_1", "call_run1_2", "call_run1_3"]
    assert {c.type for c in calls} == {"function"}


def test_native_arguments_become_compact_json() -> None:
    """Object arguments and JSON-string arguments both become one compact JSON string;
    an unparseable string is kept as it is; missing arguments are "{}"."""
    calls = native(
        [
            {"function": {"name": "get_weather", "arguments": {"city": "Zürich", "n": [1, 2]}}},
            {"function": {"name": "get_weather", "arguments": '{ "city" : "Paris" }'}},
            {"function": {"name": "get_weather", "arguments": "{city: Paris"}},
            {"function": {"name": "get_time"}},
        ]
    )
    assert [c.arguments for c in calls] == [
        '{"city":"Zürich","n":[1,2]}',
        '{"city":"Paris"}',
        "{city: Paris",
        "{}",
    ]


def test_native_flattened_form_and_name_matching() -> None:
    """The flat {name, arguments} form is accepted; names match declared tools exactly,
    else by a unique case-insensitive match, else stay as they are."""
    calls = native(
        [
            {"name": "GET_WEATHER", "arguments": {"city": "Paris"}},
            {"name": "get_time", "arguments": {}},
            {"name": "unknown_tool", "arguments": {}},
        ]
    )
    assert [c.name for c in calls] == ["get_weather", "get_time", "unknown_tool"]
    ambiguous = ToolPolicy(tools=(ToolSpec("Foo"), ToolSpec("foo")))
    assert native([{"name": "FOO"}], ambiguous)[0].name == "FOO"
    assert native([{"name": "foo"}], ambiguous)[0].name == "foo"


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ("[{", "not valid JSON"),
        ('"calls"', "not a JSON array"),
        ("[1]", 'tool_calls[0] has no function "name"; dropped'),
        ('[{"function": {"arguments": "{}"}}]', "tool_calls[0] has no"),
    ],
)
def test_native_malformed(raw: str, error: str) -> None:
    """Malformed metadata gives no calls and says why."""
    result = parse_native_tool_calls(raw, POLICY, "r")
    assert result.calls == ()
    assert error in result.errors[0]


@pytest.mark.parametrize("raw", ["", "  ", "null", "[]"])
def test_native_empty(raw: str) -> None:
    """Empty metadata means no native calls and no error."""
    assert parse_native_tool_calls(raw, POLICY, "r").errors == ()
    assert parse_native_tool_calls(raw, POLICY, "r").calls == ()


# --- validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("calls", "policy", "message"),
    [
        (
            [call("foo")],
            POLICY,
            'tool call "foo" names no declared tool (declared: get_weather, get_time)',
        ),
        ([call("get_time", "[1]")], POLICY, 'tool "get_time" arguments are not a JSON object'),
        ([call("get_time", "{x")], POLICY, 'tool "get_time" arguments are not valid JSON'),
        (
            [call("get_weather", "{}")],
            POLICY,
            "tool \"get_weather\" arguments: 'city' is a required property (at $, rule 'required')",
        ),
        (
            [call("get_weather", '{"city": "Paris", "unit": "kelvin"}')],
            POLICY,
            "tool \"get_weather\" arguments: 'kelvin' is not one of ['celsius', 'fahrenheit'] "
            "(at $.unit, rule 'enum')",
        ),
        (
            [call("get_weather", '{"city": "Paris", "x": 1}')],
            POLICY,
            "rule 'additionalProperties'",
        ),
        (
            [call("get_time")],
            ToolPolicy(POLICY.tools, ToolChoice("none")),
            'tool_choice is "none" but the model called "get_time"',
        ),
        ([], ToolPolicy(POLICY.tools, ToolChoice("required")), "made no tool call"),
        (
            [],
            ToolPolicy(POLICY.tools, ToolChoice("function", "get_time")),
            'tool_choice is "get_time" but the model made no tool call',
        ),
        (
            [call("get_weather", '{"city": "Paris"}')],
            ToolPolicy(POLICY.tools, ToolChoice("function", "get_time")),
            'tool_choice names "get_time" but the model called "get_weather"',
        ),
        (
            [call("get_time"), call("get_time", id_="call_2")],
            ToolPolicy(POLICY.tools, parallel_tool_calls=False),
            "parallel_tool_calls is false but the model made 2 tool calls",
        ),
    ],
)
def test_validation_failures(calls: list[ToolCall], policy: ToolPolicy, message: str) -> None:
    """Each rule, when broken, gives a message naming the tool and the failing rule."""
    error = validate_tool_calls(calls, policy)
    assert error is not None
    assert message in error


@pytest.mark.parametrize(
    ("calls", "policy"),
    [
        ([call("get_weather", '{"city": "Paris", "unit": "celsius"}')], POLICY),
        ([call("get_time"), call("get_time", id_="c2")], POLICY),
        ([], POLICY),
        ([], ToolPolicy(POLICY.tools, ToolChoice("none"))),
        ([call("get_time")], ToolPolicy(POLICY.tools, ToolChoice("required"), False)),
    ],
)
def test_validation_passes(calls: list[ToolCall], policy: ToolPolicy) -> None:
    """Calls that keep every rule validate."""
    assert validate_tool_calls(calls, policy) is None


def test_schema_dialect_follows_dollar_schema() -> None:
    """A draft-07 schema is validated as draft-07 (tuple `items`), the default is 2020-12."""
    draft7 = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"pair": {"type": "array", "items": [{"type": "integer"}]}},
    }
    spec = validate_tool_definition(fn("pair", parameters=draft7), 0)
    policy = ToolPolicy(tools=(spec,))
    assert validate_tool_calls([call("pair", '{"pair": [1, "x"]}')], policy) is None
    error = validate_tool_calls([call("pair", '{"pair": ["x"]}')], policy)
    assert error is not None
    assert "at $.pair[0], rule 'type'" in error
    with pytest.raises(RequestError):
        validate_tool_definition(
            fn("pair", parameters={k: v for k, v in draft7.items() if k != "$schema"}), 0
        )


def test_remote_refs_are_never_fetched() -> None:
    """A `$ref` to another document fails validation with a message; nothing is fetched."""
    spec = ToolSpec("f", parameters={"$ref": "https://example.invalid/schema.json"})
    error = validate_tool_calls([call("f")], ToolPolicy(tools=(spec,)))
    assert error is not None
    assert "unresolvable $ref" in error


def test_local_refs_resolve() -> None:
    """A `$ref` into the schema's own `$defs` works."""
    schema = {
        "type": "object",
        "properties": {"c": {"$ref": "#/$defs/city"}},
        "$defs": {"city": {"type": "string"}},
    }
    policy = ToolPolicy(tools=(ToolSpec("f", parameters=schema),))
    assert validate_tool_calls([call("f", '{"c": "Paris"}')], policy) is None
    assert validate_tool_calls([call("f", '{"c": 1}')], policy) is not None


# --- synthesis ---------------------------------------------------------------------


def test_synthesis_of_valid_calls() -> None:
    """Calls found in text get ids call_{prefix}_{index}, declared names and compact
    JSON arguments; the cleaned text is returned alongside."""
    text = (
        "Checking.\n<tool_call>\n"
        '{"name": "Get_Weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time"}</tool_call>'
    )
    syn = synthesize_tool_calls(text, POLICY, "r9", FORMATS)
    assert syn.error is None
    assert syn.candidate_found
    assert syn.cleaned == "Checking."
    assert syn.calls == (
        ToolCall("call_r9_0", "get_weather", '{"city":"Paris","unit":"celsius"}'),
        ToolCall("call_r9_1", "get_time", "{}"),
    )


@pytest.mark.parametrize(
    ("text", "policy", "message"),
    [
        ("<tool_call>{not json}</tool_call>", POLICY, "tool call 1: not valid JSON"),
        (
            '<tool_call>{"name": "get_time", "arguments": "{x"}</tool_call>',
            POLICY,
            'tool call 1 ("get_time"): arguments are not valid JSON',
        ),
        ('<tool_call>{"name": "nope"}</tool_call>', POLICY, 'tool call "nope" names no'),
        (
            '{"name": "get_weather", "arguments": {}}',
            POLICY,
            "'city' is a required property",
        ),
        (
            '[TOOL_CALLS][{"name": "get_time", "arguments": [1]}]',
            POLICY,
            "not a JSON object",
        ),
        ("Plain answer.", ToolPolicy(POLICY.tools, ToolChoice("required")), "no tool call"),
        (
            '<tool_call>{"name": "get_time"}</tool_call>',
            ToolPolicy(POLICY.tools, ToolChoice("none")),
            'tool_choice is "none"',
        ),
        (
            '<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "get_time"}'
            "</tool_call>",
            ToolPolicy(POLICY.tools, parallel_tool_calls=False),
            "parallel_tool_calls is false",
        ),
    ],
)
def test_synthesis_failures(text: str, policy: ToolPolicy, message: str) -> None:
    """A candidate that fails to parse or breaks a rule is a validation error, no calls."""
    syn = synthesize_tool_calls(text, policy, "r", FORMATS)
    assert syn.error is not None
    assert message in syn.error
    assert syn.calls == ()


def test_synthesis_without_candidates() -> None:
    """Plain text (including prose mentioning a tag) yields no calls, no candidate, no
    error, and cleaned text equal to the input."""
    for text in ["Sunny, 21 °C.", "I will use <tool_call> tags.", '{"debug": true}']:
        syn = synthesize_tool_calls(text, POLICY, "r", FORMATS)
        assert (syn.calls, syn.candidate_found, syn.error, syn.cleaned) == ((), False, None, text)


# --- output shapes -----------------------------------------------------------------


def test_tool_calls_list() -> None:
    """The stream delta form carries an index per call; the message form omits it."""
    calls = [ToolCall("c0", "get_time", "{}"), ToolCall("c1", "get_weather", '{"city":"P"}')]
    assert tool_calls_list(calls, indexed=True) == [
        {
            "index": 0,
            "id": "c0",
            "type": "function",
            "function": {"name": "get_time", "arguments": "{}"},
        },
        {
            "index": 1,
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"P"}'},
        },
    ]
    assert tool_calls_list(calls[:1], indexed=False) == [
        {"id": "c0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    ]


def test_unstreamed_remainder() -> None:
    """The remainder is what follows the emitted prefix; a non-prefix gives nothing."""
    assert unstreamed_remainder("Hello world", "Hello") == " world"
    assert unstreamed_remainder("Hello", "") == "Hello"
    assert unstreamed_remainder("Hello", "Help") == ""


@pytest.mark.parametrize("dialect", [[], 5, {"a": 1}])
def test_a_schema_whose_dialect_is_not_a_string_is_a_400(dialect: object) -> None:
    """`$schema` that is not a string is a bad tool definition (400), never an internal error."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$schema": dialect}}}
    with pytest.raises(RequestError) as info:
        validate_tool_definition(tool, 0)
    assert info.value.param == "tools[0].function.parameters"
    assert "$schema must be a string" in info.value.message


def test_a_local_ref_that_points_nowhere_is_a_400() -> None:
    """A `#...` $ref the schema cannot resolve is the caller's mistake at request time (400),
    not a tool_validation_error on every call later; resolvable refs are fine."""
    bad = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/x"}}}
    with pytest.raises(RequestError, match="points nowhere"):
        validate_tool_definition(bad, 0)
    good = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/x"}},
                "$defs": {"x": {"type": "string"}},
            },
        },
    }
    assert validate_tool_definition(good, 0).name == "f"
