"""Bad input never gets a 500: seeded, mutated requests against a real edge.

Valid bodies (streaming and not, with tools, response formats, reasoning and
sampling fields) have fields replaced by arbitrary JSON, removed, or nested
deeper, and go over a real socket to the edge and a real node. Every answer
must be a completion, a stream that ends with exactly one terminal, or an
OpenAI-shaped error with a 4xx/5xx status the edge documents: never a 500,
never a traceback.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx

from tests.integration.conftest import RunningEdge

CHAT = "/v1/chat/completions"
DOCUMENTED = {400, 404, 413, 422, 502, 503, 504}
SEED = 20261130
REQUESTS = 150

_BASES: list[dict[str, Any]] = [
    {"model": "sim-echo", "messages": [{"role": "user", "content": "hello there"}]},
    {
        "model": "sim-echo",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "temperature": 0.5,
        "max_tokens": 20,
        "stop": ["x"],
    },
    {
        "model": "sim-echo",
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "d",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    },
    {
        "model": "sim-echo",
        "stream": True,
        "messages": [{"role": "user", "content": "{}"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "object"}}},
        "strict_output": True,
        "stream_buffer": True,
        "reasoning": {"exclude": False},
        "metadata": {"trace_stream": "1"},
    },
]  # fmt: skip


def _value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["null", "bool", "int", "float", "str", "list", "dict"]
    if depth > 2:
        kinds = kinds[:5]
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, -1, 1, 2**31, 2**64, rng.randint(-1000, 1000)])
    if kind == "float":
        return rng.choice([0.5, -3.5, 1e308, 2.0])
    if kind == "str":
        return rng.choice(["", "x", "sim-echo", "function", "$ref", "<tool_call>", "\u0000", "é"])
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["type", "name", "$schema", "a", "function", "content"]): _value(
        rng, depth + 1) for _ in range(rng.randint(0, 3))}  # fmt: skip


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


def _mutate(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        paths = _paths(body)
        if not paths:
            break
        path = rng.choice(paths)
        parent = body
        for step in path[:-1]:
            parent = parent[step]
        action = rng.random()
        if action < 0.6:
            parent[path[-1]] = _value(rng)
        elif action < 0.8 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = [parent[path[-1]]]
    return body


def _check_stream(text: str) -> None:
    frames = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert frames, "a stream has frames"
    last = frames[-1]
    if last == "[DONE]":
        assert frames.count("[DONE]") == 1
    else:
        error = json.loads(last)["error"]
        assert set(error) == {"message", "type", "param", "code"}


async def test_mutated_requests_never_get_a_500(edge: RunningEdge) -> None:
    """Any mutation of a valid request is answered, never with a 500 or a traceback."""
    rng = random.Random(SEED)
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        for _ in range(REQUESTS):
            body = _mutate(rng, rng.choice(_BASES))
            response = await client.post(CHAT, content=json.dumps(body).encode())
            assert response.status_code != 500, (body, response.text)
            assert "Traceback" not in response.text
            if response.status_code == 200:
                if response.headers["content-type"].startswith("text/event-stream"):
                    _check_stream(response.text)
                else:
                    assert response.json()["object"] == "chat.completion"
            else:
                assert response.status_code in DOCUMENTED, (body, response.text)
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
    await edge.wait_idle()
