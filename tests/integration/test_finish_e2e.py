"""End to end: a node's finish_reason becomes one of OpenAI's, or an error terminal.

A sim-script completes its run with the finish_reason an engine would send;
the caller, over a real socket, sees only OpenAI's values: vLLM's and
SGLang's `abort` is a run_error (an error frame mid-stream, 502 not
streamed), an unknown value is `stop`, and the node's own value stays on the
run's outcome.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.conftest import RunningEdge, chat_body, script
from tests.integration.test_chat_e2e import parse_sse

CHAT = "/v1/chat/completions"


def ending_with(finish_reason: str) -> str:
    return script(
        {"type": "delta", "delta": "Partial "},
        {"type": "delta", "delta": "answer"},
        {"type": "complete", "metadata": {"finish_reason": finish_reason}},
    )


@pytest.mark.parametrize("reason", ["abort", "cancelled"])
async def test_unfinished_run_streaming_ends_with_one_error_frame(
    edge: RunningEdge, http: httpx.AsyncClient, reason: str
) -> None:
    """Streamed: the text that came is sent, then exactly one run_error frame naming the
    node's value; no finish chunk, no [DONE]."""
    body = chat_body("sim-script", ending_with(reason), stream=True)
    response = await http.post(CHAT, json=body)
    assert response.status_code == 200
    payloads = parse_sse(response.content)
    assert "[DONE]" not in payloads
    frames = [json.loads(p) for p in payloads]
    errors = [f for f in frames if "error" in f]
    assert errors == [frames[-1]]
    assert errors[0]["error"]["type"] == "run_error"
    assert f'"{reason}"' in errors[0]["error"]["message"]
    choices = [f["choices"][0] for f in frames[:-1]]
    assert all(c["finish_reason"] is None for c in choices)
    assert "".join(c["delta"].get("content", "") for c in choices) == "Partial answer"
    run_id = frames[0]["id"].removeprefix("chatcmpl-")
    outcome = await edge.wait_outcome(run_id)
    assert (outcome.status, outcome.error_type) == ("error", "run_error")
    assert outcome.node_finish_reason == reason


async def test_unfinished_run_non_streaming_is_502(
    edge: RunningEdge, http: httpx.AsyncClient
) -> None:
    """Not streamed: an aborted run is a 502 run_error, never a 200 with a cut answer."""
    response = await http.post(CHAT, json=chat_body("sim-script", ending_with("abort")))
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "run_error"
    assert '"abort"' in error["message"]


@pytest.mark.parametrize(
    ("reason", "expected"),
    [("eos_token", "stop"), ("something_new", "stop"), ("max_tokens", "length")],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_other_values_become_openai_values(
    edge: RunningEdge, http: httpx.AsyncClient, reason: str, expected: str, stream: bool
) -> None:
    """A value OpenAI's clients do not know is mapped (unknown ones to stop); the outcome
    keeps what the node sent."""
    body = chat_body("sim-script", ending_with(reason), stream=stream)
    response = await http.post(CHAT, json=body)
    assert response.status_code == 200
    if stream:
        frames = [json.loads(p) for p in parse_sse(response.content)[:-1]]
        run_id = frames[0]["id"].removeprefix("chatcmpl-")
        assert frames[-1]["choices"][0]["finish_reason"] == expected
    else:
        answer = response.json()
        run_id = answer["id"].removeprefix("chatcmpl-")
        assert answer["choices"][0]["finish_reason"] == expected
        assert answer["choices"][0]["message"]["content"] == "Partial answer"
    outcome = await edge.wait_outcome(run_id)
    assert (outcome.finish_reason, outcome.node_finish_reason) == (expected, reason)
