"""The Messages API (Anthropic) over the one stream core: request translation, rendering
and error shapes. Pure and synchronous; the wire end to end is in
tests/integration/test_messages_e2e.py (the three-way property is in test_responses.py).
"""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest

from edge.api.messages import parse_messages_request
from edge.api.messages_out import MessagesRenderer, anthropic_error
from edge.errors import RequestError, status_of
from edge.stream.events import Usage
from edge.stream.output import ContentOut, ErrorOut, FinishOut, ReasoningOut, RoleOut, ToolCallsOut
from edge.stream.toolcall import ToolCall


def parse(body: dict[str, Any]) -> Any:
    return parse_messages_request(json.dumps(body).encode())


def test_conversation_becomes_chat_messages() -> None:
    """system blocks, a system role inside messages (Claude Code), text and image blocks,
    tool_use with thinking on the assistant turn, tool_result before the user's text."""
    parsed = parse({
        "model": "m", "max_tokens": 10,
        "system": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "b"}],
        "messages": [
            {"role": "system", "content": "inner"},
            {"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "AA"}},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "done"},
                {"type": "text", "text": "thanks"},
            ]},
        ],
    })  # fmt: skip
    messages = parsed.chat.messages
    assert [m.role for m in messages] == ["system", "system", "user", "assistant", "tool", "user"]
    assert messages[0].text() == "a\nb"
    assert messages[2].parts[1].raw == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AA"},
    }
    assistant = messages[3]
    assert assistant.text() == "calling"
    assert assistant.reasoning_content == "hmm"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [
        ("t1", "f", {"x": 1})
    ]
    assert (messages[4].tool_call_id, messages[4].text()) == ("t1", "done")
    assert messages[5].text() == "thanks"


def test_options_reach_the_run() -> None:
    """max_tokens, stop_sequences, top_k, tools (server tools dropped), tool_choice any with
    parallel use off, thinking, output_config.effort, metadata.user_id."""
    parsed = parse({
        "model": "m", "max_tokens": 32000, "stop_sequences": ["END"], "top_k": 5,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "defer_loading": True},
                  {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "output_config": {"effort": "max"}, "metadata": {"user_id": "u1"},
        "context_management": {"edits": []},
    })  # fmt: skip
    chat = parsed.chat
    assert chat.max_tokens == 32000
    assert chat.stop == ("END",)
    assert chat.extra == {"top_k": 5}
    assert [t.name for t in chat.tools.tools] == ["f"]
    assert chat.tools.choice.mode == "required"
    assert chat.tools.parallel_tool_calls is False
    assert parsed.thinking
    assert (chat.include_reasoning, chat.reasoning_explicit) == (True, True)
    assert chat.reasoning_effort == "high"
    assert chat.user == "u1"
    assert len(parsed.dropped) == 1


@pytest.mark.parametrize(
    ("thinking", "exposed"),
    [
        (None, False),
        ({"type": "disabled"}, False),
        ({"type": "enabled", "budget_tokens": 1024}, True),
        ({"type": "adaptive"}, True),
        ({"type": "adaptive", "display": "omitted"}, False),
    ],
)
def test_thinking_decides_whether_reasoning_is_shown(
    thinking: dict[str, Any] | None, exposed: bool
) -> None:
    user = {"role": "user", "content": "x"}
    body: dict[str, Any] = {"model": "m", "max_tokens": 1, "messages": [user]}
    if thinking is not None:
        body["thinking"] = thinking
    chat = parse(body).chat
    assert chat.include_reasoning is exposed


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": []}, "max_tokens"),
        ({"model": "m", "max_tokens": 1}, "messages"),
        ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
         "max_tokens"),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "bot", "content": "x"}]},
         "messages[0].role"),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "server_tool_use"}]}]}, "messages[0].content.0.type"),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "thinking": {"type": "maybe"}}, "thinking.type"),
    ],
)  # fmt: skip
def test_refused_requests(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as refused:
        parse(body)
    assert refused.value.param == param


@pytest.mark.parametrize(
    ("status", "edge_type", "expected"),
    [
        (400, "invalid_request_error", (400, "invalid_request_error")),
        (401, "invalid_request_error", (401, "authentication_error")),
        (404, "invalid_request_error", (404, "not_found_error")),
        (413, "invalid_request_error", (413, "request_too_large")),
        (429, "rate_limit_exceeded", (429, "rate_limit_error")),
        (503, "overloaded", (529, "overloaded_error")),
        (502, "run_error", (502, "api_error")),
        (504, "timeout", (504, "api_error")),
        (422, "tool_validation_error", (422, "invalid_request_error")),
    ],
)
def test_error_shapes(status: int, edge_type: str, expected: tuple[int, str]) -> None:
    """Every edge error as Anthropic's status and error type; the edge's type stays in
    the message."""
    got_status, body = anthropic_error(status, edge_type, "why")
    assert (got_status, body["error"]["type"]) == expected
    assert body["type"] == "error"
    assert body["error"]["message"].endswith("why")


def test_whole_message() -> None:
    """thinking, text and tool_use blocks in order; stop_reason tool_use; usage."""
    renderer = MessagesRenderer("r1", "m", status_of=status_of)
    call = ToolCall(id="call_1", name="f", arguments='{"a": 1}')
    renderer.add([RoleOut(), ReasoningOut("think"), ContentOut("hi"), ToolCallsOut((call,)),
                  FinishOut("tool_calls", Usage(3, 4, 0, 2))])  # fmt: skip
    message = renderer.response()
    assert message["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "hi"},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
    ]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"]["input_tokens"] == 1  # the 3 prompt tokens but the 2 cached
    assert message["usage"]["cache_read_input_tokens"] == 2


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (Usage(11, 4, 0, 4), (7, 4)),
        (Usage(11, 4, 0, 0), (11, 0)),
        (Usage(5, 1, 0, 9), (0, 5)),  # a node saying more cached than its prompt: all of it
        (None, (0, 0)),
    ],
)
def test_usage_as_anthropic_counts_it(usage: Usage | None, expected: tuple[int, int]) -> None:
    """Anthropic's `input_tokens` leave the cached ones out: input + cache read + cache
    creation is the node's prompt tokens, in the Message and in the stream's
    message_delta alike."""
    whole = MessagesRenderer("r1", "m", status_of=status_of)
    whole.add([RoleOut(), ContentOut("hi"), FinishOut("stop", usage)])
    streamed = MessagesRenderer("r2", "m", status_of=status_of)
    raw = streamed.encode([RoleOut(), ContentOut("hi"), FinishOut("stop", usage)]).decode()
    (delta,) = [json.loads(f.split("\ndata: ")[1]) for f in raw.split("\n\n")
                if f.startswith("event: message_delta")]  # fmt: skip
    for counted in (whole.response()["usage"], delta["usage"]):
        got = (counted["input_tokens"], counted["cache_read_input_tokens"])
        assert got == expected
        assert counted["cache_creation_input_tokens"] == 0
        assert counted["output_tokens"] == (usage.output_tokens if usage else 0)


def test_message_start_carries_the_prompt_tokens_given() -> None:
    """`message_start`'s usage: the prompt tokens the renderer was given (the edge's
    estimate), nothing output or cached yet; the Message and `message_delta` keep the
    node's count."""
    streamed = MessagesRenderer("r1", "m", status_of=status_of, prompt_tokens=42)
    raw = streamed.encode([RoleOut(), ContentOut("hi"), FinishOut("stop", Usage(40, 1, 0, 8))])
    frames = {f.split("\n")[0]: json.loads(f.split("\ndata: ")[1]) for f in raw.decode().split(
        "\n\n") if f}  # fmt: skip
    assert frames["event: message_start"]["message"]["usage"] == {
        "input_tokens": 42, "output_tokens": 0,
        "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0,
    }  # fmt: skip
    assert frames["event: message_delta"]["usage"]["input_tokens"] == 32
    whole = MessagesRenderer("r2", "m", status_of=status_of, prompt_tokens=42)
    whole.add([RoleOut(), ContentOut("hi"), FinishOut("stop", Usage(40, 1, 0, 8))])
    assert whole.response()["usage"]["input_tokens"] == 32


@pytest.mark.parametrize(
    ("stops", "node_reason", "named", "expected"),
    [
        (("END", "STOP"), "stop", "STOP", ("stop_sequence", "STOP")),  # the node names it
        (("END", "STOP"), "stop_sequence", "STOP", ("stop_sequence", "STOP")),
        (("END",), "stop_sequence", "", ("stop_sequence", "END")),  # the only one
        (("END", "STOP"), "stop_sequence", "", ("stop_sequence", None)),  # which: unknown
        ((), "stop_sequence", "", ("stop_sequence", None)),  # the model's own stop string
        (("END",), "stop", "OTHER", ("end_turn", None)),  # not one of the request's
        (("END",), "stop", "", ("end_turn", None)),  # vLLM without its stop_reason
        (("END",), "length", "END", ("max_tokens", None)),
    ],
)
def test_stop_sequence(
    stops: tuple[str, ...], node_reason: str, named: str, expected: tuple[str, str | None]
) -> None:
    """`stop_sequence` names the request's stop sequence that ended the text: the one the
    node names, else the only one when the node says one matched; else null."""
    finish_reason = "length" if node_reason == "length" else "stop"
    finish = FinishOut(finish_reason, None, node_reason, named)
    whole = MessagesRenderer("r1", "m", status_of=status_of, stop_sequences=stops)
    whole.add([RoleOut(), ContentOut("up to the"), finish])
    message = whole.response()
    assert (message["stop_reason"], message["stop_sequence"]) == expected
    streamed = MessagesRenderer("r2", "m", status_of=status_of, stop_sequences=stops)
    raw = streamed.encode([RoleOut(), ContentOut("up to the"), finish]).decode()
    (delta,) = [json.loads(f.split("\ndata: ")[1]) for f in raw.split("\n\n")
                if f.startswith("event: message_delta")]  # fmt: skip
    assert (delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]) == expected


def test_tool_result_is_error_reaches_the_model() -> None:
    """`is_error: true` on a tool_result: its content (a string or blocks) after `Error: `;
    false or absent: as sent; not a boolean: refused."""

    def results(*blocks: dict[str, Any]) -> list[Any]:
        parsed = parse({"model": "m", "max_tokens": 5, "messages": [
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": f"t{i}", "name": "f", "input": {}}
                for i in range(len(blocks))]},
            {"role": "user", "content": list(blocks)},
        ]})  # fmt: skip
        return [m.text() for m in parsed.chat.messages if m.role == "tool"]

    assert results(
        {"type": "tool_result", "tool_use_id": "t0", "content": "no such city", "is_error": True},
        {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
         "content": [{"type": "text", "text": "timed out"}]},
        {"type": "tool_result", "tool_use_id": "t2", "content": "", "is_error": True},
        {"type": "tool_result", "tool_use_id": "t3", "content": "22 C", "is_error": False},
        {"type": "tool_result", "tool_use_id": "t4", "content": "sunny"},
    ) == ["Error: no such city", "Error: timed out", "Error:", "22 C", "sunny"]  # fmt: skip
    with pytest.raises(RequestError) as refused:
        results({"type": "tool_result", "tool_use_id": "t0", "content": "x", "is_error": "yes"})
    assert refused.value.param == "messages[1].content.0.is_error"


def test_a_stream_keeps_none_of_the_text_it_sent() -> None:
    """Streamed, a Message's text goes out in its deltas and is not kept (a stream's
    block events never repeat it): 8 MiB through the renderer leaves under 256 KiB."""
    renderer = MessagesRenderer("r1", "m", status_of=status_of)
    renderer.encode([RoleOut()])
    chunk = "x" * 65536
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(128):
            renderer.encode([ContentOut(chunk), ReasoningOut(chunk)])
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 256 * 1024


def test_stream_error_event() -> None:
    renderer = MessagesRenderer("r1", "m", status_of=status_of)
    raw = renderer.encode([RoleOut(), ContentOut("x"), ErrorOut("run_error", "boom")])
    last = raw.decode().split("\n\n")[-2]
    assert last.startswith("event: error\n")
    data = json.loads(last.split("\n")[1].removeprefix("data: "))
    assert data == {"type": "error", "error": {"type": "api_error", "message": "run_error: boom"}}
