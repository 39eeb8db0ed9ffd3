"""Tests of the request half of `edge.node.convert`: what of a chat request reaches the node.

Each test parses a real request body with `parse_chat_request`, maps it with
`run_request_from_chat`, and sends the RunRequest through protobuf bytes, so
what is checked is what a node decodes.
"""

from __future__ import annotations

import json
from typing import Any

from edge.api.request import parse_chat_request
from edge.contract._proto.iop.node import v1 as pb
from edge.node.convert import run_request_from_chat

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": WEATHER_PARAMS,
        "strict": True,
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
# Arguments exactly as a model produced them earlier: spacing and key order are kept.
ARGS_1 = '{"city":  "Paris", "unit":"celsius"}'
ARGS_2 = '{ "tz": "Europe/Paris" }'
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Two lookups needed.",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": ARGS_1}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time",
                                                              "arguments": ARGS_2}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": '{"temp": 21}'},
    {
        "role": "tool",
        "tool_call_id": "call_b",
        "content": [{"type": "text", "text": "14:05"}],
    },
    {"role": "assistant", "content": "It is 21 degrees and 14:05."},
    {"role": "user", "content": "Thanks!"},
]  # fmt: skip


def to_node(**fields: Any) -> pb.RunRequest:
    """The RunRequest a node decodes for a request body with `fields`."""
    body = {"model": "m", "messages": CONVERSATION, **fields}
    request = parse_chat_request(json.dumps(body).encode())
    message = run_request_from_chat(request, run_id="r1", model="m", deadline_unix_ms=5)
    return pb.RunRequest.parse(bytes(message))


def test_assistant_tool_calls_reach_the_node_intact() -> None:
    """An assistant message's tool_calls keep their ids, type, names and argument strings
    byte for byte, in order; its missing content stays absent; its reasoning is kept."""
    assistant = to_node().messages[2]
    assert assistant.role == "assistant"
    assert assistant.content is None
    assert assistant.reasoning_content == "Two lookups needed."
    assert [(c.id, c.type, c.name, c.arguments) for c in assistant.tool_calls] == [
        ("call_a", "function", "get_weather", ARGS_1),
        ("call_b", "function", "get_time", ARGS_2),
    ]


def test_tool_results_reach_the_node_intact() -> None:
    """Tool result messages keep role tool, the tool_call_id they answer, and their content
    (a string as a string, an array as parts)."""
    messages = to_node().messages
    first, second = messages[3], messages[4]
    assert (first.role, first.tool_call_id, first.content) == ("tool", "call_a", '{"temp": 21}')
    assert not first.parts
    assert (second.role, second.tool_call_id, second.content) == ("tool", "call_b", None)
    assert [(p.type, p.text) for p in second.parts] == [("text", "14:05")]


def test_conversation_order_and_roles_are_kept() -> None:
    """Every message reaches the node, in order, with its role."""
    assert [m.role for m in to_node().messages] == [m["role"] for m in CONVERSATION]
    assert [bool(m.tool_calls) for m in to_node().messages] == [
        "tool_calls" in m for m in CONVERSATION
    ]


def test_declared_tools_and_choice_reach_the_node() -> None:
    """Tools keep name, description, schema (as JSON) and strict; a named tool_choice is the
    function's name; parallel_tool_calls false is sent."""
    run = to_node(
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
    )
    weather, time = run.tools
    assert (weather.type, weather.name, weather.description) == (
        "function",
        "get_weather",
        "Current weather for a city.",
    )
    assert json.loads(weather.parameters_json) == WEATHER_PARAMS
    assert weather.strict is True
    assert (time.name, time.parameters_json, time.strict) == ("get_time", "", None)
    assert run.tool_choice == "get_time"
    assert run.parallel_tool_calls is False


def test_tool_choice_modes_and_defaults() -> None:
    """tool_choice modes are sent by name; with tools and no choice it is "auto" and
    parallel_tool_calls true; without tools both are left to the node."""
    assert to_node(tools=[TIME], tool_choice="required").tool_choice == "required"
    assert to_node(tools=[TIME], tool_choice="none").tool_choice == "none"
    run = to_node(tools=[TIME])
    assert (run.tool_choice, run.parallel_tool_calls) == ("auto", True)
    run = to_node()
    assert (run.tools, run.tool_choice, run.parallel_tool_calls) == ([], "", None)


def test_reasoning_effort_and_user_travel_in_extra_json() -> None:
    """Fields without a contract field of their own reach the node in extra_json."""
    request = parse_chat_request(
        json.dumps({
            "model": "m", "messages": [{"role": "user", "content": "x"}],
            "reasoning": {"effort": "high"}, "user": "u-1", "top_k": 5,
        }).encode()
    )  # fmt: skip
    message = run_request_from_chat(request, run_id="r", model="m")
    assert json.loads(message.extra_json) == {"top_k": 5, "reasoning_effort": "high", "user": "u-1"}
