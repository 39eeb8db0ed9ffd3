"""What a stream's answer becomes once the node says it is complete.

This module owns the decisions a session makes once, at the end: which tool
calls the answer returns (native ones, else those synthesized from its whole
text) and what text the tool-text filter still holds; whether strict output
honours the request's response_format; and the placeholder written when a
run produced reasoning but no visible answer. Each is a function of what the
session kept; `edge.stream.session` writes what they return and claims the
terminal (its text flow, `edge.stream.sessionflow`, writes the placeholder).

It does not know the session's state or output events, nor HTTP, SSE or I/O;
JSON Schema `$ref`s are never fetched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edge.stream.events import Complete
from edge.stream.logprobs import LogprobTrack
from edge.stream.sessionsettings import SessionSettings
from edge.stream.toolcall import ToolCall, Violation
from edge.stream.toolcheck import check_tool_calls
from edge.stream.toolparse import loads as strict_json
from edge.stream.tools import (
    parse_native_tool_calls,
    schema_error,
    synthesize_tool_calls,
    typed_native_tool_calls,
    unstreamed_remainder,
)
from edge.stream.tooltext import ToolTextFilter

__all__ = [
    "ToolResolution",
    "hidden_reasoning_fallback",
    "output_format_problem",
    "reasoning_only_fallback",
    "resolve_tool_calls",
]

# Placeholders for a run that produced reasoning but no visible answer, keyed
# by finish_reason. The caller never receives an empty completion.
_HIDDEN_FALLBACK = {
    "length": "[The model reached its output limit while reasoning and produced no answer.]",
    "content_filter": "[The model's answer was withheld by a content filter.]",
}
_HIDDEN_FALLBACK_DEFAULT = "[The model produced reasoning but no answer.]"


def hidden_reasoning_fallback(finish_reason: str) -> str:
    return _HIDDEN_FALLBACK.get(finish_reason, _HIDDEN_FALLBACK_DEFAULT)


def reasoning_only_fallback(reasoning: str, finish_reason: str) -> str:
    return f"{hidden_reasoning_fallback(finish_reason)}\n\nReasoning:\n{reasoning.strip()}"


@dataclass(frozen=True, slots=True)
class ToolResolution:
    """The completion's tool calls, as `resolve_tool_calls` found them."""

    calls: tuple[ToolCall, ...] = ()
    # Whether the calls (or the error) came from the node's own tool-call fields.
    native: bool = False
    # Text the tool-text filter held back that is content after all: written
    # before the calls (and before the error, if any).
    pending: str = ""
    # A `tool_validation_error` that ends the session.
    error: str | None = None
    # What the returned calls break (report mode), for the outcome.
    violations: tuple[Violation, ...] = ()


def resolve_tool_calls(
    event: Complete,
    settings: SessionSettings,
    tool_filter: ToolTextFilter | None,
    content: list[str] | None,
    emitted: list[str] | None,
    lp: LogprobTrack | None,
) -> ToolResolution:
    """The completion's tool calls and whether they were native.

    Native calls (typed, or JSON in an older node's metadata) win over
    text; otherwise calls are synthesized from the whole `content` when
    tools were declared (`tool_filter` is there). A validation failure (as the
    policy's mode says, `edge.stream.toolcheck`) is an error, and so is native
    metadata that cannot be read whole: a call is never silently dropped.
    The filter is flushed, and with logprobs realigned to what is written.
    """
    policy = settings.tools
    run_id = settings.run_id
    native: tuple[ToolCall, ...] = ()
    parsed = None
    if event.tool_calls:
        parsed = typed_native_tool_calls(event.tool_calls, policy, run_id)
    elif raw_native := event.metadata.get("tool_calls"):  # a node older than the typed field
        parsed = parse_native_tool_calls(raw_native, policy, run_id)
    if parsed is not None:
        if parsed.errors:
            return ToolResolution(native=True, error=parsed.errors[0])
        native = parsed.calls
    if native:
        pending = ""
        if tool_filter is not None:
            pending = tool_filter.flush_non_candidate()
        check = check_tool_calls(native, policy)
        return ToolResolution(native, True, pending, check.error, check.violations)
    if tool_filter is not None:
        assert content is not None  # kept whenever tools are declared
        assert emitted is not None
        result = synthesize_tool_calls("".join(content), policy, run_id, settings.tool_formats)
        if result.error is not None:
            return ToolResolution(error=result.error)
        if result.calls:
            written = "".join(emitted)
            remainder = unstreamed_remainder(result.cleaned, written)
            if lp is not None and lp.tool is not None:
                lp.tool.realign(remainder, "".join(content)[len(written) :])
            return ToolResolution(result.calls, pending=remainder, violations=result.violations)
        return ToolResolution(pending=tool_filter.flush(), violations=result.violations)
    return ToolResolution()


def output_format_problem(fmt: Mapping[str, Any] | None, written: list[str] | None) -> str | None:
    """Strict output: what keeps the `written` content from honouring the request's
    response_format (None: nothing)."""
    if not fmt or fmt.get("type") not in ("json_object", "json_schema"):
        return None
    text = "".join(written or ())
    try:
        value = strict_json(text)
    except ValueError as exc:
        return f"response_format {fmt['type']}: the output is not valid JSON: {exc}"
    if fmt["type"] == "json_object" and not isinstance(value, dict):
        return "response_format json_object: the output is not a JSON object"
    schema = (fmt.get("json_schema") or {}).get("schema")
    if fmt["type"] == "json_schema" and isinstance(schema, dict):
        error = schema_error(schema, value)
        if error is not None:
            return f"response_format json_schema: {error}"
    return None
