"""Holding returned tool calls to the request: the validation policy and its rules.

This module owns what a call may break (a declared name, the tool's
`parameters` schema, `tool_choice`, `parallel_tool_calls`), in which order
the rules are checked, and what each `tool_validation` mode does with a
broken one:

- `strict`: the first violation ends the answer (`tool_validation_error`);
- `report`: a readable call is returned as the model wrote it, and what it
  breaks is reported as `Violation`s (the HTTP layer counts and logs them);
  a schema violation of a tool declared `"strict": true` still ends the
  answer, unless the request asked for `report` itself;
- `off`: nothing is checked against the declared tools or `tool_choice`.

In every mode a call that cannot be read (arguments that are not JSON) ends
the answer: it is never returned, dropped or shown as content. Which mode a
request gets is `tool_validation_mode`'s. Pure: no I/O, no logging, no
metrics; JSON Schema `$ref`s are never fetched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from edge.stream.jsontext import loads
from edge.stream.schema import schema_error, validation_budget
from edge.stream.toolcall import ToolCall, ToolPolicy, ToolValidation, Violation, ViolationRule

__all__ = [
    "ToolCheck",
    "check_tool_calls",
    "tool_validation_mode",
    "validate_tool_calls",
]


def tool_validation_mode(
    request: ToolValidation | None,
    model: ToolValidation | None,
    *,
    request_strict_output: bool | None,
    model_strict: bool,
) -> ToolValidation:
    """The request's `tool_validation` mode; the request decides first, then the model.

    1. the request's `tool_validation`;
    2. `strict` when the request asks for strict output (`strict_output: true`);
    3. the model's `tool_validation` (`[models.NAME] tool_validation`);
    4. `strict` when the strict output policy applies (the model's `strict`,
       unless the request turned strict output off);
    5. `report`.
    """
    if request is not None:
        return request
    if request_strict_output:
        return "strict"
    if model is not None:
        return model
    if model_strict and request_strict_output is None:
        return "strict"
    return "report"


@dataclass(frozen=True, slots=True)
class ToolCheck:
    """The verdict on a completion's calls: `error` ends the answer; else the calls are
    returned, with `violations` to report."""

    error: str | None = None
    violations: tuple[Violation, ...] = ()


def check_tool_calls(calls: Sequence[ToolCall], policy: ToolPolicy) -> ToolCheck:
    """Hold `calls` to `policy`, as its `validation` mode says (see the module doc)."""
    mode = policy.validation
    reported: list[Violation] = []
    with validation_budget():
        for rule, tool, message in _violations(calls, policy, against_tools=mode != "off"):
            if rule is None or mode == "strict" or _strict_tool(policy, rule, tool):
                return ToolCheck(error=message)
            reported.append(Violation(rule, tool, message))
    return ToolCheck(violations=tuple(reported))


def validate_tool_calls(calls: Sequence[ToolCall], policy: ToolPolicy) -> str | None:
    """The first way `calls` break the declared tools or `tool_choice`, or None.

    Strict whatever the policy's mode. `tool_choice` "required" or a named
    function with no call is a violation (a run under them must end with a
    call); "none" with any call is one. All the calls share one validation
    budget, so many calls cost no more than one.
    """
    with validation_budget():
        for _rule, _tool, message in _violations(calls, policy, against_tools=True):
            return message
    return None


def _strict_tool(policy: ToolPolicy, rule: ViolationRule, tool: str) -> bool:
    """A schema violation of a tool declared `"strict": true`: not let through, unless the
    request chose its mode itself."""
    if rule != "schema" or not policy.strict_tools:
        return False
    spec = policy.spec(tool)
    return spec is not None and spec.strict is True


# (rule, called tool, message); rule None: the call cannot be read.
_Found = tuple[ViolationRule | None, str, str]


def _violations(
    calls: Sequence[ToolCall], policy: ToolPolicy, *, against_tools: bool
) -> Iterator[_Found]:
    """Every violation of `calls`, in the order the rules are checked.

    Without `against_tools` only unreadable arguments are looked for. After a
    call names no declared tool, its arguments are only checked to be JSON.
    """
    choice = policy.choice
    if against_tools:
        if choice.mode == "none" and calls:
            yield (
                "tool_choice",
                calls[0].name,
                (f'tool_choice is "none" but the model called "{calls[0].name}"'),
            )
        if choice.mode in ("required", "function") and not calls:
            yield (
                "tool_choice",
                choice.name or "",
                (f'tool_choice is "{choice.name or choice.mode}" but the model made no tool call'),
            )
        if not policy.parallel_tool_calls and len(calls) > 1:
            names = ", ".join(f'"{call.name}"' for call in calls)
            yield (
                "parallel_tool_calls",
                calls[1].name,
                (
                    f"parallel_tool_calls is false but the model made {len(calls)} tool calls "
                    f"({names})"
                ),
            )
    for call in calls:
        name = call.name
        spec = policy.spec(name) if against_tools else None
        if against_tools:
            if choice.mode == "function" and name != choice.name:
                yield (
                    "tool_choice",
                    name,
                    (f'tool_choice names "{choice.name}" but the model called "{name}"'),
                )
            if spec is None:
                declared = ", ".join(tool.name for tool in policy.tools) or "none"
                yield (
                    "unknown_tool",
                    name,
                    (f'tool call "{name}" names no declared tool (declared: {declared})'),
                )
        try:
            arguments = loads(call.arguments)
        except ValueError as exc:
            yield None, name, f'tool "{name}" arguments are not valid JSON: {exc}'
            continue
        if spec is None:
            continue
        if not isinstance(arguments, dict):
            yield "schema", name, f'tool "{name}" arguments are not a JSON object'
        elif spec.parameters is not None:
            problem = schema_error(spec.parameters, arguments)
            if problem is not None:
                yield "schema", name, f'tool "{name}" arguments: {problem}'
