"""Abusive chat requests (authenticated): each is valid, and each is costly for a naive edge.

- a tool whose argument schema has a catastrophic-backtracking `pattern`,
  and a model (sim-script) writing an argument that backtracks;
- thousands of tools with distinct schemas;
- model text of thousands of lines of `{` with one tool declared (the text
  tool-call scan);
- a long answer of 64 KiB deltas, for clients that stop reading it;
and the normal requests that run beside them.
"""

from __future__ import annotations

import json
from typing import Any

REDOS_PATTERN = "^(a+)+$"
DELTA_BYTES = 64 * 1024


def _script(*events: dict[str, Any]) -> str:
    return json.dumps({"events": list(events)})


def _complete(finish: str = "stop") -> dict[str, Any]:
    return {"type": "complete", "metadata": {"finish_reason": finish}}


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _scripted(stream: bool, tools: list[dict[str, Any]], *events: dict[str, Any]) -> dict[str, Any]:
    """A sim-script request: the model plays `events`."""
    body: dict[str, Any] = {
        "model": "sim-script",
        "stream": stream,
        "messages": [{"role": "user", "content": _script(*events)}],
    }
    if tools:
        body["tools"] = tools
    return body


def redos(a_count: int = 30) -> dict[str, Any]:
    """A tool with `pattern: ^(a+)+$`; the model calls it with `a` * a_count + `b`."""
    call = {"name": "match", "arguments": {"s": "a" * a_count + "b"}}
    text = f"<tool_call>{json.dumps(call)}</tool_call>"
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": REDOS_PATTERN}},
        "required": ["s"],
    }
    delta = {"type": "delta", "delta": text}
    return _scripted(True, [_tool("match", schema)], delta, _complete("tool_calls"))


def tool_flood(count: int = 2000) -> dict[str, Any]:
    """`count` tools, each with its own schema (distinct names, bounds and enums)."""
    tools = [
        _tool(
            f"tool_{i}",
            {
                "type": "object",
                "properties": {
                    f"p{i}": {"type": "string", "minLength": i % 7, "maxLength": 100 + i},
                    f"q{i}": {"type": "integer", "enum": [i, i + 1, i + 2]},
                },
                "required": [f"p{i}"],
            },
        )
        for i in range(count)
    ]
    return {
        "model": "sim-echo",
        "tools": tools,
        "messages": [{"role": "user", "content": "hello"}],
    }


def brace_lines(lines: int = 4000) -> dict[str, Any]:
    """Model text of `lines` lines of `{`, one tool declared: the text tool-call scan."""
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    }
    delta = {"type": "delta", "delta": "{\n" * lines}
    return _scripted(True, [_tool("get_weather", weather)], delta, _complete())


def big_answer(deltas: int) -> dict[str, Any]:
    """A streamed answer of `deltas` deltas of 64 KiB each (sim-script's `repeat`)."""
    delta = {"type": "delta", "delta": "x" * DELTA_BYTES, "repeat": deltas}
    return _scripted(True, [], delta, _complete())


def normal(i: int, *, stream: bool, pace_ms: int = 0) -> tuple[dict[str, Any], str]:
    """A normal request and the content its answer must carry: `sim-echo`, or with
    `pace_ms` a sim-script writing the same words `pace_ms` apart (a stream that stays in
    flight a while)."""
    words = f"normal request {i} keeps flowing"
    if not pace_ms:
        message = {"role": "user", "content": words}
        return {"model": "sim-echo", "stream": stream, "messages": [message]}, words
    events: list[dict[str, Any]] = []
    for word in words.split():
        events += [{"type": "delta", "delta": word + " "}, {"sleep_ms": pace_ms}]
    return _scripted(stream, [], *events, _complete()), words
