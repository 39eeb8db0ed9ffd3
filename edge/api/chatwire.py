"""The chat completions request as msgspec decodes it: the wire Structs.

This module owns the wire shape of a chat request (which fields it may carry,
and their JSON types) and the conversion of decoded JSON values into it:
msgspec checks the types (so a type error carries a JSON path) and its errors
become `RequestError`s exactly once, here, with `param` from that path. The
rules msgspec cannot express, and the frozen values a request becomes, are
`edge.api.request`'s.

It must not know about nodes, routing, config defaults, HTTP or streams. No
trio, quart, grpclib or asyncio.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec

from edge.api.body import TYPE_WORDS, json_type
from edge.api.checks import invalid
from edge.errors import RequestError

__all__ = [
    "EXTRA_FIELDS",
    "WireMessage",
    "WireRequest",
    "WireToolCall",
    "wire_request",
]

# Sampling extensions (vLLM / OpenRouter style) passed to the node as sent.
EXTRA_FIELDS: Final = (
    "top_k", "min_p", "repetition_penalty", "logit_bias", "logprobs", "top_logprobs",
    "ignore_eos", "min_tokens", "chat_template_kwargs",
)  # fmt: skip


class _Wire(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True, gc=False):
    """Base of the wire Structs. Unknown fields are ignored, as vLLM does; None = absent."""


class WireFunction(_Wire):
    name: str
    arguments: str


class WireToolCall(_Wire):
    id: str
    function: WireFunction
    type: str = "function"


class WireMessage(_Wire):
    role: str
    # The parts as decoded: the conversion copies a list's objects, not its items of
    # type Any, and 150,000 parts of a 4 MB body copied held ~29 MiB more at the
    # parse's peak. Each part is checked to be an object as it is read (`not_an_object`).
    content: str | list[Any] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[WireToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class WireStreamOptions(_Wire):
    include_usage: bool | None = None


class WireReasoning(_Wire):
    exclude: bool | None = None
    enabled: bool | None = None
    effort: str | None = None


class WireRequest(_Wire):
    model: str
    messages: list[WireMessage]
    stream: bool | None = None
    stream_options: WireStreamOptions | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    include_reasoning: bool | None = None
    reasoning: WireReasoning | None = None
    reasoning_effort: str | None = None
    strict_output: bool | None = None
    stream_buffer: bool | None = None
    tool_validation: str | None = None
    # EXTRA_FIELDS: type-checked, then passed on exactly as decoded (1 stays an int).
    top_k: int | None = None
    min_p: int | float | None = None
    repetition_penalty: int | float | None = None
    logit_bias: dict[str, int | float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def wire_request(obj: dict[str, Any]) -> WireRequest:
    """A chat request decoded into JSON values, as its wire Struct.

    Raises:
        RequestError: a field is missing or of the wrong JSON type; `param` names
            it (e.g. "messages[0].role").
    """
    try:
        return msgspec.convert(obj, WireRequest)
    except msgspec.ValidationError as exc:
        raise _translate(str(exc)) from None


def not_an_object(param: str, value: object) -> RequestError:
    """The error for `value` at `param` where an object belongs, in the words the
    conversion's own errors use (for the values it does not check: content parts)."""
    got = TYPE_WORDS[json_type(value)]
    return RequestError(
        f"Invalid type for '{param}': expected an object, but got {got} instead.", param=param
    )


# --- msgspec errors -> RequestError, once ---------------------------------------

_ERROR: Final = re.compile(r"(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?", re.DOTALL)
_MISSING: Final = re.compile(r"Object missing required field `(?P<name>[^`]+)`")
_EXPECTED: Final = re.compile(r"Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`")


def _translate(error: str) -> RequestError:
    """A msgspec ValidationError message -> a RequestError with `param` from its path."""
    match = _ERROR.fullmatch(error)
    assert match is not None  # the pattern matches any string
    detail = match["detail"]
    # "$.messages[0].role" -> "messages[0].role"; msgspec elides dict keys as "[...]".
    param = (match["path"] or "").removeprefix(".").replace("[...]", "")
    if missing := _MISSING.fullmatch(detail):
        param = f"{param}.{missing['name']}" if param else missing["name"]
        return RequestError(f"Missing required parameter: '{param}'.", param=param)
    if expected := _EXPECTED.fullmatch(detail):
        got = TYPE_WORDS.get(expected["got"], expected["got"])
        if not param:
            return RequestError(f"The request body must be a JSON object, but got {got}.")
        want = [TYPE_WORDS.get(t, f"`{t}`") for t in expected["want"].split(" | ")]
        wanted = want[0] if len(want) == 1 else f"one of {', '.join(want[:-1])} or {want[-1]}"
        return RequestError(
            f"Invalid type for '{param}': expected {wanted}, but got {got} instead.", param=param
        )
    if not param:
        return RequestError(f"Invalid request body: {detail}.")
    return invalid(param, detail[:1].lower() + detail[1:])
