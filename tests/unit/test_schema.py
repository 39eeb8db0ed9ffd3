"""Tests of callers' JSON Schemas: limits, RE2 regexes, the validation budget."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge.errors import RequestError
from edge.stream.bounds import (
    MAX_PATTERN_PROGRAM,
    MAX_REQUEST_SCHEMA_BYTES,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_TOOLS,
    MAX_VALIDATION_STEPS,
)
from edge.stream.schema import schema_error, schema_limit_problem, schema_problem
from edge.stream.toolcall import ToolCall, ToolPolicy, ToolSpec
from edge.stream.tools import check_declared_schema, validate_tool_calls, validate_tools

REDOS = "^(a+)+$"
# Python's re takes minutes on this against REDOS (each extra "a" doubles it).
EVIL = "a" * 40 + "b"


def obj(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("schema", "instance", "rule"),
    [
        (obj(w={"type": "string", "pattern": REDOS}), {"w": EVIL}, "'pattern'"),
        ({"patternProperties": {REDOS: {}}, "additionalProperties": False}, {EVIL: 1}, "regexes"),
        ({"patternProperties": {REDOS: {"type": "string"}}}, {"a" * 40: 1}, "'type'"),
        ({"propertyNames": {"pattern": REDOS}}, {EVIL: 1}, "'pattern'"),
        (
            # A $ref back to a root that names its dialect stays on the RE2 validator.
            {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                **obj(w={"pattern": REDOS}, next={"$ref": "#"}),
            },
            {"next": {"next": {"w": EVIL}}},
            "'pattern'",
        ),
        (
            {"$schema": "http://json-schema.org/draft-07/schema#", **obj(w={"pattern": REDOS})},
            {"w": EVIL},
            "'pattern'",
        ),
        (
            {"$defs": {"w": {"pattern": REDOS}}, **obj(w={"$ref": "#/$defs/w"})},
            {"w": EVIL},
            "'pattern'",
        ),
    ],
)
def test_redos_patterns_run_in_linear_time(
    schema: dict[str, Any], instance: Any, rule: str
) -> None:
    """Every keyword that runs a caller's regex (pattern, patternProperties,
    additionalProperties, through $ref and any dialect) runs it in RE2: the input
    that takes Python's re minutes is judged at once, and judged right."""
    assert schema_problem(schema) is None
    error = schema_error(schema, instance)
    assert error is not None
    assert rule in error


def test_matching_values_pass() -> None:
    """RE2 matches what the pattern means (search semantics, as JSON Schema says)."""
    schema = obj(w={"type": "string", "pattern": "b+"})
    assert schema_error(schema, {"w": "abba"}) is None
    assert schema_error(schema, {"w": "aaa"}) is not None


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (obj(w={"pattern": r"^(a)\1$"}), "$.properties.w.pattern"),
        (obj(w={"pattern": "(?=a)a"}), "lookaround"),
        (obj(w={"pattern": "(?<!a)b"}), "RE2 cannot compile"),
        ({"patternProperties": {r"(x)\1": {}}}, r"(x)\\1"),
        (obj(w={"pattern": "(.{1,100}){1,10}$"}), str(MAX_PATTERN_PROGRAM)),
    ],
)
def test_patterns_re2_cannot_run_are_refused(schema: dict[str, Any], expected: str) -> None:
    """A pattern RE2 cannot compile, or only into a program past the limit, makes the
    schema invalid, and the reason says where or which limit."""
    problem = schema_problem(schema)
    assert problem is not None
    assert expected in problem
    with pytest.raises(RequestError) as raised:
        check_declared_schema(schema, "p")
    assert raised.value.param == "p"


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (nested(MAX_SCHEMA_DEPTH), f"limit {MAX_SCHEMA_DEPTH}"),
        (nested(10_000), f"limit {MAX_SCHEMA_DEPTH}"),
        (obj(**{f"p{i}": {"type": "string"} for i in range(2000)}), str(MAX_SCHEMA_BYTES)),
        (obj(x={"$schema": "http://json-schema.org/draft-07/schema#"}), "below its root"),
        ({"unevaluatedProperties": False, "patternProperties": {"a": {}}}, "not supported"),
    ],
)
def test_limits_name_themselves(schema: dict[str, Any], expected: str) -> None:
    """A schema past a limit is refused before any costly check, naming the limit."""
    problem = schema_limit_problem(schema)
    assert problem is not None
    assert expected in problem
    with pytest.raises(RequestError, match=r"limit|root|supported"):
        check_declared_schema(schema, "p")


def test_data_keywords_are_not_read_as_schemas() -> None:
    """`$schema` inside `const`/`enum`/`default` is data, not a nested dialect; a
    property named `const` is still a schema."""
    schema = obj(
        a={"const": {"$schema": "x"}},
        const={"type": "object", "properties": {"y": {"$schema": "x"}}},
    )
    problem = schema_limit_problem(schema)
    assert problem is not None
    assert "$.properties.const.properties.y" in problem
    assert schema_limit_problem(obj(a={"enum": [{"$schema": "x"}]})) is None


def tool(i: int, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"t{i}", "parameters": parameters}}


def test_tool_count_is_capped_before_any_schema_check() -> None:
    """More than MAX_TOOLS tools: a 400 on `tools` naming the limit (even with
    schemas that would each be refused)."""
    tools = [tool(i, {"type": 5}) for i in range(MAX_TOOLS + 1)]
    with pytest.raises(RequestError, match=f"limit is {MAX_TOOLS} tools") as raised:
        validate_tools(tools)
    assert raised.value.param == "tools"
    assert len(validate_tools([tool(i, obj()) for i in range(MAX_TOOLS)])) == MAX_TOOLS


def test_total_schema_bytes_are_capped() -> None:
    """Schemas each within MAX_SCHEMA_BYTES but together past MAX_REQUEST_SCHEMA_BYTES."""
    big = obj(**{f"p{i:04}": {"type": "string"} for i in range(MAX_SCHEMA_BYTES // 40)})
    count = MAX_REQUEST_SCHEMA_BYTES // (MAX_SCHEMA_BYTES // 2) + 1
    with pytest.raises(RequestError, match=str(MAX_REQUEST_SCHEMA_BYTES)) as raised:
        validate_tools([tool(i, big) for i in range(count)])
    assert raised.value.param == "tools"


@pytest.mark.timeout(30)
def test_validation_stops_at_its_step_budget() -> None:
    """A value that would need more than MAX_VALIDATION_STEPS keyword checks is an
    error naming the limit, not unbounded work; a small value against the same
    schema validates normally."""
    schema = {"type": "array", "items": {"anyOf": [{"pattern": f"^x{i}$"} for i in range(50)]}}
    error = schema_error(schema, ["y"] * 10_000)
    assert error is not None
    assert str(MAX_VALIDATION_STEPS) in error
    assert schema_error(schema, ["x1", "x2"]) is None
    assert schema_error(schema, ["y"]) is not None


def test_the_calls_of_one_answer_share_one_budget() -> None:
    """Many tool calls each well within the budget, together past it: a validation
    error naming the limit, so the work of one answer is bounded, not per call."""
    schema = obj(xs={"type": "array", "items": {"type": "string"}})
    policy = ToolPolicy(tools=(ToolSpec("f", parameters=schema),))
    arguments = json.dumps({"xs": ["a"] * 60})
    one = [ToolCall(id="c0", name="f", arguments=arguments)]
    assert validate_tool_calls(one, policy) is None
    many = [ToolCall(id=f"c{i}", name="f", arguments=arguments) for i in range(100)]
    error = validate_tool_calls(many, policy)
    assert error is not None
    assert str(MAX_VALIDATION_STEPS) in error
