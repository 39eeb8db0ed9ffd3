"""Tests of iop-node's request body (`edge.nodes.upstream.request`): a RunRequest as the
upstream's chat completions body."""

from __future__ import annotations

import pytest

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.request import chat_request_body


def test_request_body_carries_every_field() -> None:
    """Messages (parts, tool calls, tool results), tools, choice, sampling and extras go up."""
    request = pb.RunRequest(
        run_id="r1",
        model="Qwen/Qwen3-8B",
        messages=[
            pb.Message(role="system", content="Be brief."),
            pb.Message(
                role="user",
                parts=[
                    pb.ContentPart(type="text", text="What is this?"),
                    pb.ContentPart(
                        type="image_url",
                        json='{"type":"image_url","image_url":{"url":"data:image/png;base64,AA"}}',
                    ),
                ],
                name="ann",
            ),
            pb.Message(
                role="assistant",
                tool_calls=[pb.ToolCall(id="c1", type="function", name="f", arguments='{"a":1}')],
                reasoning_content="hidden",
            ),
            pb.Message(role="tool", content="42", tool_call_id="c1"),
        ],
        tools=[
            pb.Tool(
                type="function",
                name="f",
                description="does f",
                parameters_json='{"type":"object"}',
                strict=True,
            )
        ],
        tool_choice="f",
        parallel_tool_calls=False,
        temperature=0.2,
        top_p=0.9,
        max_tokens=64,
        stop=["END"],
        seed=7,
        presence_penalty=0.1,
        frequency_penalty=0.3,
        response_format_json='{"type":"json_object"}',
        metadata={"user_tag": "x"},
        deadline_unix_ms=123,
        extra_json='{"top_k": 20, "stream": false, "model": "other"}',
    )
    assert chat_request_body(request) == {
        "model": "Qwen/Qwen3-8B",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                ],
                "name": "ann",
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a":1}'},
                    }
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "description": "does f",
                    "parameters": {"type": "object"},
                    "strict": True,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False,
        "temperature": 0.2,
        "top_p": 0.9,
        "max_tokens": 64,
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.3,
        "stop": ["END"],
        "response_format": {"type": "json_object"},
        "metadata": {"user_tag": "x"},
        "top_k": 20,
    }


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_tool_choice_modes_pass_as_strings(choice: str) -> None:
    request = pb.RunRequest(model="m", tools=[pb.Tool(name="f")], tool_choice=choice)
    assert chat_request_body(request)["tool_choice"] == choice


def test_minimal_request_leaves_defaults_to_the_server() -> None:
    """Absent sampling fields stay absent, so the upstream's defaults apply."""
    request = pb.RunRequest(model="m", messages=[pb.Message(role="user", content="hi")])
    assert chat_request_body(request) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_request_caps_top_logprobs_at_twenty() -> None:
    """logprobs and top_logprobs reach the upstream as sent, top_logprobs at most 20."""
    request = pb.RunRequest(model="m", extra_json='{"logprobs": true, "top_logprobs": 50}')
    sent = chat_request_body(request)
    assert (sent["logprobs"], sent["top_logprobs"]) == (True, 20)


def test_the_runs_cache_salt_goes_as_vllms_and_a_callers_own_never_does() -> None:
    """The run's KV-cache scope is sent as `cache_salt`; one in the caller's extra fields
    (another key's, guessed) is dropped, and a shared run sends none."""
    forged = '{"cache_salt": "theirs", "top_k": 5}'
    body = chat_request_body(pb.RunRequest(model="m", cache_salt="mine", extra_json=forged))
    assert (body["cache_salt"], body["top_k"]) == ("mine", 5)
    shared = chat_request_body(pb.RunRequest(model="m", extra_json=forged))
    assert "cache_salt" not in shared
