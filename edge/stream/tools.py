"""Tool calls: declared-tool validation, native normalization, synthesis, checks.

This module owns the rules that tie calls to the request: which tool
definitions and `tool_choice` values are acceptable, how native calls from run
metadata and calls found in text become `ToolCall`s (ids, names, arguments).
Whether calls break the declared tools or `tool_choice`, and what the
validation mode does about it, is `edge.stream.toolcheck`'s; text formats live
in `edge.stream.toolparse`. It does not know the stream, HTTP, or any I/O;
JSON Schema `$ref`s are never fetched.

Arguments are always a compact JSON string:
`json.dumps(value, separators=(",", ":"), ensure_ascii=False)`; a native
string that does not parse as JSON is kept as it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from edge.errors import RequestError
from edge.stream.bounds import MAX_REQUEST_SCHEMA_BYTES, MAX_TOOLS
from edge.stream.schema import (
    schema_error,
    schema_limit_problem,
    schema_problem,
    schema_size,
)
from edge.stream.toolcall import ToolCall, ToolChoice, ToolPolicy, ToolSpec, Violation
from edge.stream.toolcheck import check_tool_calls, validate_tool_calls
from edge.stream.toolparse import DEFAULT_FORMATS, loads, parse_tool_text

__all__ = [
    "NativeToolCalls",
    "Synthesis",
    "check_declared_schema",
    "compact_json",
    "match_tool_name",
    "parse_native_tool_calls",
    "schema_error",
    "schema_problem",
    "synthesize_tool_calls",
    "typed_native_tool_calls",
    "unstreamed_remainder",
    "validate_tool_calls",
    "validate_tool_choice",
    "validate_tool_definition",
    "validate_tools",
]

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CHOICE_MODES: dict[str, Literal["none", "auto", "required"]] = {
    "none": "none",
    "auto": "auto",
    "required": "required",
}


def compact_json(value: object) -> str:
    """The one serialization of arguments used in responses."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# --- request side: what the caller declared ------------------------------------


def validate_tool_definition(obj: object, index: int, *, limits_checked: bool = False) -> ToolSpec:
    """One entry of `tools`; raises `RequestError` naming the bad field.

    `limits_checked`: `validate_tools` has already held its `parameters` to the
    schema limits, so they are not measured again.
    """
    where = f"tools[{index}]"
    if not isinstance(obj, dict):
        raise RequestError(f"{where} must be an object", param=where)
    if obj.get("type") != "function":
        raise RequestError(f'{where}.type must be "function"', param=f"{where}.type")
    fn = obj.get("function")
    if not isinstance(fn, dict):
        raise RequestError(f"{where}.function must be an object", param=f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(
            f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$",
            param=f"{where}.function.name",
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestError(
            f"{where}.function.description must be a string",
            param=f"{where}.function.description",
        )
    parameters = fn.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise RequestError(
                f"{where}.function.parameters must be a JSON Schema object",
                param=f"{where}.function.parameters",
            )
        param = f"{where}.function.parameters"
        if not limits_checked:
            _check_schema_limits(parameters, param)
        _check_schema_validity(parameters, param)
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(
            f"{where}.function.strict must be a boolean", param=f"{where}.function.strict"
        )
    return ToolSpec(name=name, description=description or "", parameters=parameters, strict=strict)


def check_declared_schema(schema: Mapping[str, Any], param: str) -> None:
    """A caller's schema, within the limits and valid, else a `RequestError` for `param`."""
    _check_schema_limits(schema, param)
    _check_schema_validity(schema, param)


def _check_schema_limits(schema: Mapping[str, Any], param: str) -> None:
    limit = schema_limit_problem(schema)
    if limit is not None:
        raise RequestError(f"{param} {limit}.", param=param)


def _check_schema_validity(schema: Mapping[str, Any], param: str) -> None:
    problem = schema_problem(schema)
    if problem is not None:
        raise RequestError(f"{param} is not a valid JSON Schema: {problem}", param=param)


def validate_tools(obj: object) -> tuple[ToolSpec, ...]:
    """The whole `tools` array: at most `MAX_TOOLS`, every definition valid, names distinct.

    The count and the schemas' total size are checked before any costly step,
    so a flood of tools is refused in time proportional to its size.
    """
    if not isinstance(obj, list):
        raise RequestError("tools must be an array", param="tools")
    if len(obj) > MAX_TOOLS:
        raise RequestError(
            f"tools has {len(obj)} entries; the limit is {MAX_TOOLS} tools", param="tools"
        )
    total = 0
    for index, item in enumerate(obj):
        fn = item.get("function") if isinstance(item, dict) else None
        parameters = fn.get("parameters") if isinstance(fn, dict) else None
        if isinstance(parameters, dict):
            _check_schema_limits(parameters, f"tools[{index}].function.parameters")
            total += schema_size(parameters)
    if total > MAX_REQUEST_SCHEMA_BYTES:
        raise RequestError(
            f"the tools' parameter schemas are {total} bytes as JSON together; the limit is "
            f"{MAX_REQUEST_SCHEMA_BYTES} bytes",
            param="tools",
        )
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for index, item in enumerate(obj):
        spec = validate_tool_definition(item, index, limits_checked=True)
        if spec.name in seen:
            raise RequestError(
                f'tools[{index}].function.name "{spec.name}" is declared more than once',
                param=f"tools[{index}].function.name",
            )
        seen.add(spec.name)
        specs.append(spec)
    return tuple(specs)


def validate_tool_choice(obj: object, tools: Sequence[ToolSpec]) -> ToolChoice:
    """`tool_choice`; None means the OpenAI default ("auto" with tools, else "none")."""
    if obj is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(obj, str):
        mode = _CHOICE_MODES.get(obj)
        if mode is None:
            raise RequestError(
                'tool_choice must be "none", "auto", "required" or a function object',
                param="tool_choice",
            )
        if mode == "required" and not tools:
            raise RequestError('tool_choice "required" needs tools', param="tool_choice")
        return ToolChoice(mode)
    if isinstance(obj, dict) and obj.get("type") == "function":
        fn = obj.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str):
            if all(tool.name != name for tool in tools):
                raise RequestError(
                    f'tool_choice names function "{name}", which tools does not declare',
                    param="tool_choice",
                )
            return ToolChoice("function", name)
    raise RequestError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


# --- response side: what the model called --------------------------------------


def match_tool_name(name: str, tools: Sequence[ToolSpec]) -> str:
    """The declared name for `name`: exact, else a unique case-insensitive match, else as is."""
    if any(tool.name == name for tool in tools):
        return name
    folded = name.casefold()
    matches = [tool.name for tool in tools if tool.name.casefold() == folded]
    return matches[0] if len(matches) == 1 else name


def _native_arguments(value: object) -> str:
    if value is None:
        return "{}"
    if isinstance(value, str):
        if not value.strip():
            return "{}"
        try:
            return compact_json(loads(value))
        except ValueError:
            return value
    return compact_json(value)


@dataclass(frozen=True, slots=True)
class NativeToolCalls:
    """Normalized native calls, and why any input (or all of it) was dropped."""

    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()


def parse_native_tool_calls(raw: str, policy: ToolPolicy, id_prefix: str) -> NativeToolCalls:
    """Normalize run metadata's `tool_calls` (an OpenAI-format JSON array).

    Entries are `{"id"?, "type"?, "function": {"name", "arguments"}}` or the flat
    `{"name", "arguments"}`. Ids that are missing, empty or repeated become
    `call_{id_prefix}_{index}` (index in the output). Entries that are not
    objects or have no name are dropped with an error; malformed JSON gives no
    calls and one error. Empty or `null` metadata means no calls, no error.
    """
    if not raw.strip():
        return NativeToolCalls()
    try:
        data = loads(raw)
    except ValueError as exc:
        return NativeToolCalls(errors=(f"tool_calls metadata is not valid JSON: {exc}",))
    if data is None:
        return NativeToolCalls()
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        return NativeToolCalls(errors=("tool_calls metadata is not a JSON array",))
    entries: list[tuple[object, object, object] | None] = []
    for entry in data:
        fn = entry.get("function") if isinstance(entry, dict) else None
        source: Mapping[str, Any] | None = fn if isinstance(fn, dict) else None
        if source is None and isinstance(entry, dict):
            source = entry
        if not isinstance(entry, dict) or source is None:
            entries.append(None)
            continue
        arguments = source.get("arguments", source.get("parameters"))
        entries.append((entry.get("id"), source.get("name"), arguments))
    return _normalize_native(entries, policy, id_prefix)


def typed_native_tool_calls(
    typed: Sequence[ToolCall], policy: ToolPolicy, id_prefix: str
) -> NativeToolCalls:
    """Normalize the typed native calls of a run (`Complete.tool_calls`).

    The same rules as `parse_native_tool_calls`, without JSON around them:
    missing or repeated ids are chosen here, names are matched to the
    declared tools, arguments are compacted when they are JSON.
    """
    return _normalize_native([(c.id, c.name, c.arguments) for c in typed], policy, id_prefix)


def _normalize_native(
    entries: Sequence[tuple[object, object, object] | None], policy: ToolPolicy, id_prefix: str
) -> NativeToolCalls:
    """(id, name, arguments) per native call, None for an entry that is no call."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    used: set[str] = set()
    for position, entry in enumerate(entries):
        call_id, name, arguments = entry if entry is not None else (None, None, None)
        if not isinstance(name, str) or not name:
            errors.append(f'tool_calls[{position}] has no function "name"; dropped')
            continue
        if not isinstance(call_id, str) or not call_id or call_id in used:
            call_id = f"call_{id_prefix}_{len(calls)}"
            while call_id in used:
                call_id += "_"
        used.add(call_id)
        calls.append(
            ToolCall(
                id=call_id,
                name=match_tool_name(name, policy.tools),
                arguments=_native_arguments(arguments),
            )
        )
    return NativeToolCalls(tuple(calls), tuple(errors))


@dataclass(frozen=True, slots=True)
class Synthesis:
    """Calls found in content. With `error` set, `calls` is empty and the run failed;
    `violations` are what the calls returned break (the report mode)."""

    calls: tuple[ToolCall, ...] = ()
    cleaned: str = ""
    candidate_found: bool = False
    error: str | None = None
    violations: tuple[Violation, ...] = ()


def synthesize_tool_calls(
    text: str,
    policy: ToolPolicy,
    id_prefix: str,
    formats: Sequence[str] = DEFAULT_FORMATS,
) -> Synthesis:
    """Tool calls from the whole content text, held to `policy` (`check_tool_calls`).

    A candidate that failed to parse is a validation failure in every mode;
    the rules of the declared tools and `tool_choice` apply as the policy's
    validation mode says. Ids are `call_{id_prefix}_{index}`.
    """
    parsed = parse_tool_text(text, formats)
    if parsed.errors:
        return Synthesis(cleaned=parsed.cleaned, candidate_found=True, error=parsed.errors[0])
    calls = tuple(
        ToolCall(
            id=f"call_{id_prefix}_{index}",
            name=match_tool_name(call.name, policy.tools),
            arguments=compact_json(call.arguments),
        )
        for index, call in enumerate(parsed.calls)
    )
    check = check_tool_calls(calls, policy)
    if check.error is not None:
        return Synthesis(
            cleaned=parsed.cleaned, candidate_found=parsed.candidate_found, error=check.error
        )
    return Synthesis(calls, parsed.cleaned, parsed.candidate_found, violations=check.violations)


def unstreamed_remainder(cleaned: str, emitted: str) -> str:
    """The part of `cleaned` not yet shown, given the content already `emitted`.

    The tool-text filter keeps `emitted` a prefix of `cleaned`; if it is not
    (the filter hit its cap and showed raw markup), nothing more is shown.
    """
    return cleaned[len(emitted) :] if cleaned.startswith(emitted) else ""
