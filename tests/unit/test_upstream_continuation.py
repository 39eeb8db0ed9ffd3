"""iop-node's continuation of an answer (`edge.nodes.upstream.continuation`): which way a
model is continued, and the request, usage and errors of a run that continues one."""

from __future__ import annotations

from typing import Any

import pytest

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.continuation import (
    PROBE_TEXT,
    as_failure,
    continued_body,
    mode_for,
    probe_body,
    probe_continues,
    whole_usage,
)
from edge.nodes.upstream.request import chat_request_body

HELD = pb.Continuation(text="The answer is", reasoning="Think first.", output_tokens=5)


def _body(*messages: pb.Message, **fields: Any) -> dict[str, Any]:
    return chat_request_body(pb.RunRequest(model="m", messages=list(messages), **fields))


@pytest.mark.parametrize(
    ("setting", "dialect", "owner", "mode"),
    [
        ("auto", "vllm", "", "vllm"),
        ("auto", "sglang", "", "vllm"),
        ("auto", None, "vllm", "vllm"),
        ("auto", None, "sglang", "vllm"),
        ("auto", "llamacpp", "llamacpp", "none"),  # until the probe says it continues
        ("auto", None, "library", "none"),  # Ollama
        ("auto", None, "", "none"),
        ("llamacpp", None, "", "llamacpp"),
        ("vllm", "llamacpp", "", "vllm"),
        ("none", "vllm", "vllm", "none"),
    ],
)
def test_mode_by_setting_and_upstream(
    setting: str, dialect: str | None, owner: str, mode: str
) -> None:
    """A named way wins; auto is vllm for an upstream that reads as vLLM or SGLang (its
    /metrics dialect or the model's owner), and none when unsure."""
    assert mode_for(setting, dialect, owner) == mode


@pytest.mark.parametrize(
    ("dialect", "owner", "mode"),
    [("llamacpp", "", "llamacpp"), (None, "llamacpp", "llamacpp"), (None, "library", "none")],
)
def test_auto_continues_on_llamacpp_once_the_probe_says_it_does(
    dialect: str | None, owner: str, mode: str
) -> None:
    """auto on llama.cpp (its /metrics or its owned_by) is `llamacpp` once the probe
    showed the server continues, and only on llama.cpp."""
    assert mode_for("auto", dialect, owner, probed=True) == mode


def test_the_probe_asks_one_token_after_a_made_up_answer() -> None:
    """The probe continues PROBE_TEXT as `llamacpp` does; a server that starts over
    (echoes the answer) fails it, one that goes on passes."""
    body = probe_body("tiny")
    assert body["messages"][-1] == {"role": "assistant", "content": PROBE_TEXT}
    assert (body["continue_final_message"], body["max_tokens"], body["stream"]) == (True, 1, True)
    assert not probe_continues(PROBE_TEXT + " more")
    assert probe_continues(" more")
    assert probe_continues("")


def test_vllm_request_continues_the_final_message() -> None:
    """vLLM and SGLang: the partial answer is the last message, with its reasoning under
    both servers' names, `continue_final_message` on, the generation prompt off, no echo;
    max_tokens is what is left of it."""
    body = _body(pb.Message(role="user", content="q"), max_tokens=100, extra_json='{"echo": true}')
    out = continued_body(body, HELD, "vllm")
    assert out["messages"] == [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "The answer is",
            "reasoning": "Think first.",
            "reasoning_content": "Think first.",
        },
    ]
    assert (out["continue_final_message"], out["add_generation_prompt"]) == (True, False)
    assert "echo" not in out
    assert out["max_tokens"] == 95
    assert body["messages"] == [{"role": "user", "content": "q"}]  # the body is not changed


def test_llamacpp_request_prefills_the_answer_without_reasoning() -> None:
    """llama.cpp: the partial answer is the last message, with `continue_final_message`
    on and the generation prompt off (without it, a current llama-server streams the
    prefilled text back first); the reasoning is dropped; a request that ends with the
    client's own prefill has the text appended to it."""
    out = continued_body(_body(pb.Message(role="user", content="q")), HELD, "llamacpp")
    assert out["messages"][-1] == {"role": "assistant", "content": "The answer is"}
    assert (out["continue_final_message"], out["add_generation_prompt"]) == (True, False)
    prefilled = _body(
        pb.Message(role="user", content="q"), pb.Message(role="assistant", content="Sure: ")
    )
    out = continued_body(prefilled, HELD, "llamacpp")
    assert out["messages"][-1] == {"role": "assistant", "content": "Sure: The answer is"}


def test_no_continuation_mode_is_refused() -> None:
    """A body is never built to continue on an upstream that cannot."""
    with pytest.raises(ValueError, match="does not continue answers"):
        continued_body(_body(pb.Message(role="user", content="q")), HELD, "none")


def test_usage_is_the_whole_answers() -> None:
    """The upstream counts only what it generated: complete says the whole answer's
    output tokens (the earlier runs' added); other events are unchanged."""
    event = pb.RunEvent(type="complete", usage=pb.Usage(input_tokens=40, output_tokens=7))
    assert whole_usage(event, HELD).usage == pb.Usage(input_tokens=40, output_tokens=12)
    delta = pb.RunEvent(type="delta", delta="x")
    assert whole_usage(delta, HELD) == delta
    assert whole_usage(pb.RunEvent(type="complete"), HELD).usage is None


def test_an_upstream_refusing_a_continuation_is_the_nodes_failure() -> None:
    """A 4xx (not 408 or 429) answer to a continuation is a failure with no status, its
    words quoted; overloads and failures are unchanged."""
    refused = pb.RunEvent(type="error", error="", message="prefill incompatible", http_status=400)
    failed = as_failure(refused)
    assert (failed.http_status, failed.error) == (
        0,
        "upstream refused to continue the answer (400): prefill incompatible",
    )
    for status in (429, 408, 503, 0):
        event = pb.RunEvent(type="error", error="e", http_status=status)
        assert as_failure(event) == event
