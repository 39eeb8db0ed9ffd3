"""Per-model policy without HTTP: a request's own choices override its model's, None
falls back to the model's, model-only settings come from the model, and what reaches
the node is the model's forwarding policy's."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.api.request import ChatRequest, parse_chat_request
from edge.config import ModelConfig
from edge.errors import RequestError
from edge.fleet.modelpolicy import forwarded_request, session_settings


def request(**fields: Any) -> ChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_request(json.dumps(body).encode())


@given(
    model_strict=st.booleans(),
    model_buffer=st.booleans(),
    strict=st.none() | st.booleans(),
    buffer=st.none() | st.booleans(),
)
def test_the_request_decides_first_then_the_model(
    model_strict: bool, model_buffer: bool, strict: bool | None, buffer: bool | None
) -> None:
    """strict_output and stream_buffer: the request's when it sent them, else the model's."""
    model = ModelConfig(strict=model_strict, stream_buffer=model_buffer)
    fields = {
        k: v for k, v in (("strict_output", strict), ("stream_buffer", buffer)) if v is not None
    }
    settings = session_settings(model, request(**fields), "run-1")
    assert settings.run_id == "run-1"
    assert settings.strict == (model_strict if strict is None else strict)
    assert settings.stream_buffer == (model_buffer if buffer is None else buffer)


def test_model_only_settings_come_from_the_model() -> None:
    """Tool-call formats, sentinels and the reasoning parser are the model's; tracing is
    on when either the model or the request asks for it."""
    model = ModelConfig(
        tool_call_formats=("hermes",), sentinels=("<|end|>",), reasoning_parser="think",
        trace_stream=True,
    )  # fmt: skip
    settings = session_settings(model, request(), "r")
    assert settings.tool_formats == ("hermes",)
    assert settings.sentinels == ("<|end|>",)
    assert settings.reasoning_parser == "think"
    assert settings.trace
    assert not session_settings(ModelConfig(), request(), "r").trace


@pytest.mark.parametrize(
    ("stream", "holds", "whole", "held"),
    [(False, False, True, False), (False, True, True, False), (True, False, False, False),
     (True, True, False, True)],
)  # fmt: skip
def test_what_the_answer_holds(stream: bool, holds: bool, whole: bool, held: bool) -> None:
    """A non-streaming answer holds its whole output; a stream holds its text only when
    the API's streamer keeps it (and then it counts against the held-answer cap)."""
    settings = session_settings(ModelConfig(), request(stream=stream), "r", stream_holds_text=holds)
    assert settings.whole_output is whole
    assert settings.text_held is held


def test_tool_validation_is_the_request_s_then_strict_output_then_the_model_s() -> None:
    """The mode follows `tool_validation_mode`; tools are strict unless the request set a
    mode itself."""
    model = ModelConfig(tool_validation="off")
    assert session_settings(model, request(), "r").tools.validation == "off"
    assert session_settings(model, request(strict_output=True), "r").tools.validation == "strict"
    chosen = session_settings(model, request(tool_validation="report"), "r").tools
    assert chosen.validation == "report"
    assert not chosen.strict_tools
    assert session_settings(model, request(), "r").tools.strict_tools
    assert session_settings(ModelConfig(strict=True), request(), "r").tools.validation == "strict"


def test_the_node_is_sent_what_the_model_s_forwarding_policy_allows() -> None:
    """ignore_eos is dropped unless the model allows it; a max_tokens past the model's cap
    is a 400 naming the field."""
    asked = request(ignore_eos=True)
    assert "ignore_eos" not in forwarded_request(ModelConfig(), asked).extra
    assert forwarded_request(ModelConfig(allow_ignore_eos=True), asked).extra["ignore_eos"]
    with pytest.raises(RequestError) as info:
        forwarded_request(ModelConfig(max_output_tokens=10), request(max_tokens=11))
    assert info.value.status == 400
    assert "max_tokens" in info.value.message


def _schema(**json_schema: Any) -> dict[str, Any]:
    body = {"name": "city", "schema": {"type": "object"}, **json_schema}
    return {"type": "json_schema", "json_schema": body}


@pytest.mark.parametrize(
    ("fields", "model_strict", "strict", "checks"),
    [
        ({"response_format": _schema(strict=True)}, False, False, True),  # Outlines, Agents SDK
        ({"response_format": _schema(strict=False)}, False, False, False),
        ({"response_format": _schema()}, False, False, False),
        ({"response_format": {"type": "json_object"}}, False, False, False),
        ({"response_format": _schema(strict=True), "strict_output": False}, True, False, False),
        ({"response_format": _schema(strict=False)}, True, True, True),  # the model's policy
    ],
)
def test_a_strict_json_schema_has_its_answer_checked(
    fields: dict[str, Any], model_strict: bool, strict: bool, checks: bool
) -> None:
    """A json_schema with `strict: true` is checked as strict output checks it (OpenAI
    guarantees the schema), without the rest of strict output (reasoning stays shown);
    `strict_output: false` turns the check off, as it turns the model's policy off."""
    settings = session_settings(ModelConfig(strict=model_strict), request(**fields), "r")
    assert (settings.strict, settings.checks_format) == (strict, checks)
    if not model_strict:
        assert settings.expose_reasoning
