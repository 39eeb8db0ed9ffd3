"""Per-model policy: what a request's model config makes of its stream and of what
the node is sent.

`session_settings`: the settings of a request's stream session (strict output,
buffering, tool validation, reasoning parser, ...): the model's policy, then the
request's own choices (a json_schema with `strict: true` has its answer checked
against the schema, `asks_strict`, unless the request sent `strict_output: false`).
`forwarded_request`: the request as the model's forwarding policy lets it reach
the node (`edge.api.policy`). Pure but for a debug line: no
HTTP, no node, no clock; the caller looks up the model's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from loguru import logger

from edge.api.policy import apply_policy
from edge.api.request import ChatRequest
from edge.config import ModelConfig
from edge.observe.logbound import clip_join
from edge.stream.session import SessionSettings
from edge.stream.toolcheck import tool_validation_mode


def session_settings(
    model: ModelConfig, request: ChatRequest, run_id: str, *, stream_holds_text: bool = False
) -> SessionSettings:
    """The session settings of `request`, whose model's config is `model`: the model's
    policy, then the request's own choices. `stream_holds_text`: the API's streamer
    keeps the answer's text (it counts against the held-answer cap)."""
    strict = model.strict if request.strict_output is None else request.strict_output
    buffered = model.stream_buffer if request.stream_buffer is None else request.stream_buffer
    validation = tool_validation_mode(
        request.tool_validation,
        model.tool_validation,
        request_strict_output=request.strict_output,
        model_strict=model.strict,
    )
    return SessionSettings(
        run_id=run_id,
        strict=strict,
        stream_buffer=buffered,
        include_reasoning=request.include_reasoning,
        reasoning_explicit=request.reasoning_explicit,
        trace=request.trace_stream or model.trace_stream,
        tools=replace(
            request.tools,
            validation=validation,
            strict_tools=request.tool_validation is None,
        ),
        tool_formats=model.tool_call_formats,
        sentinels=model.sentinels,
        reasoning_parser=model.reasoning_parser,  # type: ignore[arg-type]
        response_format=request.response_format,
        strict_format=request.strict_output is not False and asks_strict(request.response_format),
        whole_output=not request.stream,
        text_held=request.stream and stream_holds_text,
        logprobs=request.logprobs,
    )


def asks_strict(response_format: Mapping[str, Any] | None) -> bool:
    """Whether a response_format is a json_schema with `strict: true`: OpenAI guarantees
    such an answer matches the schema, so the edge checks it (a node's constrained
    decoding makes the check pass; a node without it gets the strict output's error)."""
    if not response_format or response_format.get("type") != "json_schema":
        return False
    schema = response_format.get("json_schema")
    return isinstance(schema, Mapping) and schema.get("strict") is True


def forwarded_request(model: ModelConfig, request: ChatRequest) -> ChatRequest:
    """`request` as its model's forwarding policy lets it reach the node (a field it
    refuses raises its RequestError; what it drops is logged at debug)."""
    result = apply_policy(request, model.forward_policy)
    if result.dropped:
        logger.bind(model=request.model).debug(
            "not forwarded to the node: {}", clip_join(result.dropped)
        )
    return result.request
