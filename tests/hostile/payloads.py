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


# --- The second round: bodies that are valid JSON under every size limit, and costly. ---

# Nesting past Python's recursion limit once a few frames are on the stack.
NEST_DEPTH = 975
# What a body of the second round aims to stay under (the edge's default max_body_bytes).
BODY_BYTES = 4 * 1024 * 1024 - 4096


def _nest(depth: int = NEST_DEPTH) -> str:
    return "[" * depth + "]" * depth


def nested(variant: int, depth: int = NEST_DEPTH) -> tuple[str, bytes]:
    """(path, body): `depth` levels of `[` inside one free-form field that reaches the node,
    one of six (by `variant`): a non-text content part, `response_format` extras,
    `chat_template_kwargs`, a Messages `document` block, a Messages `tool_result` block,
    a Responses `input_file` part."""
    nest = _nest(depth)
    user = '{"role": "user", "content": "hi"}'
    bodies = [
        (
            "/v1/chat/completions",
            '{"model": "sim-echo", "messages": [{"role": "user", "content": [{"type": "text", '
            '"text": "hi"}, {"type": "image_url", "image_url": {"url": '
            f'"data:image/png;base64,iVBORw0KGgo=", "extra": {nest}}}}}]}}]}}',
        ),
        (
            "/v1/chat/completions",
            f'{{"model": "sim-echo", "messages": [{user}], "response_format": {{"type": '
            f'"json_schema", "json_schema": {{"name": "x", "schema": {{"type": "object"}}}}, '
            f'"extra": {nest}}}}}',
        ),
        (
            "/v1/chat/completions",
            f'{{"model": "sim-echo", "messages": [{user}], "chat_template_kwargs": '
            f'{{"extra": {nest}}}}}',
        ),
        (
            "/v1/messages",
            '{"model": "sim-echo", "max_tokens": 16, "messages": [{"role": "user", "content": '
            '[{"type": "document", "source": {"type": "text", "media_type": "text/plain", '
            f'"data": "hi"}}, "extra": {nest}}}, {{"type": "text", "text": "hi"}}]}}]}}',
        ),
        (
            "/v1/messages",
            '{"model": "sim-echo", "max_tokens": 16, "messages": [{"role": "user", "content": '
            '"hi"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": '
            '"f", "input": {}}]}, {"role": "user", "content": [{"type": "tool_result", '
            f'"tool_use_id": "t1", "content": "ok", "extra": {nest}}}]}}]}}',
        ),
        (
            "/v1/responses",
            '{"model": "sim-echo", "input": [{"role": "user", "content": [{"type": "input_text", '
            '"text": "hi"}, {"type": "input_file", "filename": "a.txt", "file_data": '
            f'"data:text/plain;base64,aGk=", "extra": {nest}}}]}}]}}',
        ),
    ]
    path, body = bodies[variant % len(bodies)]
    return path, body.encode()


def tiny_parts(budget: int = BODY_BYTES, per_message: int = 1000) -> bytes:
    """A chat body of as many one-character text parts as fit in `budget` bytes, in user
    messages of `per_message` parts (under the edge's parts-per-message limit)."""
    part = '{"type":"text","text":"a"}'
    message = '{"role":"user","content":[' + ",".join([part] * per_message) + "]}"
    count = (budget - 200) // (len(message) + 1)
    messages = ",".join([message] * count)
    return ('{"model":"sim-echo","messages":[' + messages + "]}").encode()


def tool_history(budget: int = BODY_BYTES, calls: int = 8000) -> bytes:
    """A chat body of `budget` bytes of tool-call history: `calls` calls and their results
    (under the edge's message-count limit), the arguments padded to fill the budget."""
    bare = _tool_history(calls, 0)
    return _tool_history(calls, max(0, (budget - len(bare)) // calls))


def _tool_history(calls: int, pad: int) -> bytes:
    turns: list[str] = []
    for i in range(calls):
        arguments = json.dumps({"q": i, "pad": "p" * pad})
        call = json.dumps(
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type":
             "function", "function": {"name": "lookup", "arguments": arguments}}]}
        )  # fmt: skip
        result = json.dumps({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"})
        turns += [call, result]
    messages = ", ".join(['{"role": "user", "content": "go"}', *turns,
                          '{"role": "user", "content": "and now?"}'])  # fmt: skip
    return ('{"model": "sim-echo", "messages": [' + messages + "]}").encode()


def many_messages(count: int = 16_000) -> bytes:
    """A chat body of `count` short messages, user and assistant in turn."""
    pair = '{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}'
    messages = ", ".join([pair] * (count // 2))
    return ('{"model": "sim-echo", "messages": [' + messages + ', {"role": "user", '
            '"content": "last"}]}').encode()  # fmt: skip


def hosted_tool(size: int = 3_900_000) -> bytes:
    """A Responses body declaring a hosted tool whose type is `size` characters long (a
    tool the edge drops, and logs that it dropped)."""
    tools = json.dumps([{"type": "x" * size}])
    return ('{"model": "sim-echo", "input": "hi", "tools": ' + tools + "}").encode()


def big_delta(size: int = 3_800_000, char: str = "<") -> dict[str, Any]:
    """A sim-script answer whose one delta is `size` copies of `char`."""
    return _scripted(True, [], {"type": "delta", "delta": char * size}, _complete())


# Script numbers a node must refuse cleanly (its timers and loop keep serving others).
BAD_SCRIPT_EVENTS: tuple[dict[str, Any], ...] = (
    {"sleep_ms": "nan"},
    {"sleep_ms": "Infinity"},
    {"sleep_ms": 1e308},
    {"sleep_ms": -5},
    {"sleep_ms": True},
    {"type": "delta", "delta": "x", "repeat": 10**12},
    {"type": "delta", "delta": "x", "repeat": -1},
    {"type": "delta", "delta": "x", "repeat": "many"},
)


def bad_script(variant: int) -> dict[str, Any]:
    """A sim-script request with one script number that a node must refuse (by `variant`)."""
    event = BAD_SCRIPT_EVENTS[variant % len(BAD_SCRIPT_EVENTS)]
    return _scripted(variant % 2 == 0, [], event, {"type": "delta", "delta": "x"}, _complete())
