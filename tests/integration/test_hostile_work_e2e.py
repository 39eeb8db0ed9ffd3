"""End to end: requests built to make the edge work hard get bounded work.

Each case once froze the event loop for seconds to minutes (a ReDoS `pattern`
run by Python's `re`, thousands of tool schemas checked one by one, a
quadratic scan of model text). Here each goes through a real edge to a real
`iop-sim-node` and must get its answer (an error or a normal one, never a
500 or a cut stream) while `/healthz` keeps answering. Bounds are generous
`fail_after`s, never wall-clock assertions.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from tests.integration.conftest import RunningEdge, chat_body, script
from tests.integration.test_chat_e2e import parse_sse

CHAT = "/v1/chat/completions"
REDOS = "^(a+)+$"
# Python's re needs minutes for this against REDOS; RE2 a few microseconds.
EVIL = "a" * 30 + "b"
REDOS_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "spell",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "pattern": REDOS}},
            "required": ["word"],
        },
    },
}
# Generous: the old code took over a minute for each of these.
BOUND_S = 20


def model_says(text: str, *, sleep_ms: int = 0) -> str:
    """A sim-script that writes `text` in 500-character deltas, optionally waits, completes."""
    deltas = [{"type": "delta", "delta": text[i : i + 500]} for i in range(0, len(text), 500)]
    pause = [{"sleep_ms": sleep_ms}] if sleep_ms else []
    return script(*deltas, *pause, {"type": "complete", "metadata": {"finish_reason": "stop"}})


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def healthz_answers(http: httpx.AsyncClient, times: int) -> None:
    for _ in range(times):
        assert (await http.get("/healthz")).status_code == 200


async def test_redos_pattern_in_a_tool_call_is_answered_while_healthz_answers(
    edge: RunningEdge, http: httpx.AsyncClient
) -> None:
    """A tool call whose argument is the ReDoS input for its schema's `pattern` gets
    its tool_validation_error at once under strict validation (a 422, streamed or not:
    the stream held the call back, so no byte was sent before the error), and /healthz
    answers while such streams are in flight."""
    text = hermes("spell", {"word": EVIL})
    streamed = chat_body(
        "sim-script",
        model_says(text, sleep_ms=100),
        tools=[REDOS_TOOL],
        stream=True,
        tool_validation="strict",
    )
    errors: list[Any] = []

    async def one_stream() -> None:
        response = await http.post(CHAT, json=streamed)
        assert response.status_code == 422
        errors.append(response.json()["error"])

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one_stream)
            nursery.start_soon(healthz_answers, http, 5)
        plain = await http.post(
            CHAT,
            json=chat_body(
                "sim-script", model_says(text), tools=[REDOS_TOOL], tool_validation="strict"
            ),
        )
    assert len(errors) == 3
    for error in errors:
        assert error["type"] == "tool_validation_error"
        assert "does not match" in error["message"]
    assert plain.status_code == 422
    assert plain.json()["error"]["type"] == "tool_validation_error"


async def test_redos_pattern_under_report_is_checked_in_time(http: httpx.AsyncClient) -> None:
    """Report mode checks the same schema within the same bound: the call comes back as
    written (the violation reported), not after minutes of backtracking."""
    text = hermes("spell", {"word": EVIL})
    body = chat_body("sim-script", model_says(text), tools=[REDOS_TOOL], tool_validation="report")
    with trio.fail_after(BOUND_S):
        response = await http.post(CHAT, json=body)
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"word": EVIL}


async def test_matching_argument_is_a_tool_call(http: httpx.AsyncClient) -> None:
    """The same tool with an argument the pattern accepts is an ordinary tool call."""
    text = hermes("spell", {"word": "aaaa"})
    body = chat_body("sim-script", model_says(text), tools=[REDOS_TOOL])
    with trio.fail_after(BOUND_S):
        response = await http.post(CHAT, json=body)
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "word": "aaaa"
    }


async def test_two_thousand_tools_get_a_400_naming_the_limit(http: httpx.AsyncClient) -> None:
    """2,000 tools with distinct schemas: a 400 naming the limit of 128, not seconds
    of schema checks."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "parameters": {"type": "object", "properties": {f"p{i}": {"type": "string"}}},
            },
        }
        for i in range(2000)
    ]
    with trio.fail_after(BOUND_S):
        response = await http.post(CHAT, json=chat_body("sim-echo", "hi", tools=tools))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "tools"
    assert "128" in error["message"]
    assert "2000" in error["message"]


async def test_backreference_pattern_is_refused_at_request_time(http: httpx.AsyncClient) -> None:
    """A pattern RE2 cannot run (a backreference) is a 400 naming where it is."""
    tool = json.loads(json.dumps(REDOS_TOOL))
    tool["function"]["parameters"]["properties"]["word"]["pattern"] = r"^(a)\1$"
    response = await http.post(CHAT, json=chat_body("sim-echo", "hi", tools=[tool]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools[0].function.parameters"
    assert "$.properties.word.pattern" in error["message"]


async def test_four_thousand_lines_of_braces_are_a_normal_answer(
    http: httpx.AsyncClient,
) -> None:
    """4,000 lines of `{` with one tool declared (a quadratic scan once took seconds):
    a normal answer whose content is the text, streamed or not."""
    text = "{\n" * 4000
    tools = [REDOS_TOOL]
    with trio.fail_after(BOUND_S):
        plain = await http.post(CHAT, json=chat_body("sim-script", model_says(text), tools=tools))
        streamed = await http.post(
            CHAT, json=chat_body("sim-script", model_says(text), tools=tools, stream=True)
        )
    assert plain.status_code == 200
    choice = plain.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text
    payloads = parse_sse(streamed.content)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def strict_format(pattern: str) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "word",
            "schema": {
                "type": "object",
                "properties": {"word": {"type": "string", "pattern": pattern}},
            },
        },
    }


async def test_strict_response_format_with_a_redos_pattern(http: httpx.AsyncClient) -> None:
    """Strict output checked against a json_schema with a ReDoS pattern: the output
    that would take Python's re minutes is refused at once (a 422: the buffered stream
    sent no byte before it), and a matching output passes."""
    extra = {"strict_output": True, "stream_buffer": True, "stream": True}
    bad = json.dumps({"word": EVIL})
    good = json.dumps({"word": "aaa"})
    with trio.fail_after(BOUND_S):
        refused = await http.post(
            CHAT,
            json=chat_body(
                "sim-script", model_says(bad), response_format=strict_format(REDOS), **extra
            ),
        )
        passed = await http.post(
            CHAT,
            json=chat_body(
                "sim-script", model_says(good), response_format=strict_format(REDOS), **extra
            ),
        )
    assert refused.status_code == 422
    assert "does not match" in refused.json()["error"]["message"]
    ok = parse_sse(passed.content)
    assert ok[-1] == "[DONE]"
    content = "".join(json.loads(p)["choices"][0]["delta"].get("content") or "" for p in ok[:-1])
    assert content == good


async def test_lookaround_in_response_format_is_refused(http: httpx.AsyncClient) -> None:
    """A lookahead in a response_format pattern is a 400 naming the parameter."""
    body = chat_body("sim-echo", "hi", response_format=strict_format("(?=a)a"))
    response = await http.post(CHAT, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "RE2" in error["message"]
