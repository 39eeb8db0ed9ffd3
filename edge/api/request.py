"""Decode and validate a chat completions request body into a `ChatRequest`.

This module owns the request half of the OpenAI wire format's rules: which
values a request's fields may hold, and the 400 each malformed body earns,
and the frozen values a valid request becomes. The body enters through
`edge.api.body` (JSON, an object, within its bounds), msgspec converts it to
the wire Structs of `edge.api.chatwire` (so type errors carry a JSON path,
and msgspec errors become `RequestError` exactly once, there); the rules
msgspec cannot express follow here in plain Python, with the shared field
checks of `edge.api.checks`. The names of `edge.api.body` every API's parser
uses are importable from here too.

It must not know about nodes, routing, config defaults, HTTP or streams: bytes
in, values out (or a `RequestError`). No trio, quart, grpclib or asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast, get_args

from edge.api.body import (
    TOO_DEEP,
    TOO_MANY_VALUES,
    check_json_bounds,
    decode_object,
    deep_is_refused,
)
from edge.api.chatwire import (
    EXTRA_FIELDS,
    WireMessage,
    WireRequest,
    WireToolCall,
    not_an_object,
    wire_request,
)
from edge.api.checks import check_chars, check_choice, check_count, check_range, invalid, missing
from edge.errors import RequestError
from edge.stream import bounds
from edge.stream.bounds import MAX_METADATA_KEYS, MAX_STOP
from edge.stream.logprobs import MAX_TOP_LOGPROBS
from edge.stream.toolcall import TOOL_VALIDATION_MODES, ToolCall, ToolPolicy, ToolValidation
from edge.stream.tools import check_declared_schema, validate_tool_choice, validate_tools

__all__ = [
    "EXTRA_FIELDS",
    "REASONING_EFFORTS",
    "RESPONSE_FORMATS",
    "ROLES",
    "TOO_DEEP",
    "TOO_MANY_VALUES",
    "ChatMessage",
    "ChatRequest",
    "ContentPart",
    "Role",
    "chat_request_from",
    "check_json_bounds",
    "decode_object",
    "deep_is_refused",
    "parse_chat_request",
]

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]

ROLES: Final = frozenset(get_args(Role))
REASONING_EFFORTS: Final = frozenset({"minimal", "low", "medium", "high"})
RESPONSE_FORMATS: Final = frozenset({"text", "json_object", "json_schema"})
# OpenAI's `service_tier` values the edge runs ("auto": the key's default).
SERVICE_TIERS: Final = frozenset({"auto", "priority", "default", "flex"})
_TOOL_VALIDATION: Final = frozenset(TOOL_VALIDATION_MODES)
_TRUTHY: Final = frozenset({"1", "true", "yes"})
# The node protocol carries max_tokens as uint32 and seed as int64.
_MAX_TOKENS: Final = 2**32 - 1
_INT64: Final = (-(2**63), 2**63 - 1)


# --- the decoded request: frozen values ----------------------------------------


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One element of an array `content`; `raw` is the whole part, for passthrough."""

    type: str
    text: str = ""  # the text of a "text" part; "" for every other type
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message; `content` is set when it was a string, `parts` when an array."""

    role: Role
    content: str | None = None
    parts: tuple[ContentPart, ...] = ()
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning_content: str | None = None

    def text(self) -> str:
        """The content string, or the text parts joined by newlines."""
        if self.content is not None:
            return self.content
        return "\n".join(part.text for part in self.parts if part.type == "text")


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated chat completions request.

    Sampling fields are None when the caller left them out, so the node's
    defaults apply; `strict_output`, `stream_buffer` and `tool_validation` are
    None when absent, so the edge's config defaults apply.
    """

    model: str
    messages: tuple[ChatMessage, ...]
    stream: bool = False
    include_usage: bool = False
    tools: ToolPolicy = field(default_factory=ToolPolicy)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    # OpenAI's hint for routing to a cache that holds the prompt: names a session
    # (`edge.fleet.affinity.SessionKey`).
    prompt_cache_key: str | None = None
    # The service tier asked for: "priority", "default" or "flex"; None: none, or "auto"
    # (the key's default: `edge.fleet.tenants.Tenant.tier_for`).
    service_tier: str | None = None
    # The caller did not turn reasoning off / asked for it in so many words.
    include_reasoning: bool = True
    reasoning_explicit: bool = False
    reasoning_effort: str | None = None
    strict_output: bool | None = None
    stream_buffer: bool | None = None
    tool_validation: ToolValidation | None = None
    trace_stream: bool = False
    # `logprobs: true`: content chunks carry their tokens' log-probabilities
    # (also passed to the node in `extra`, with `top_logprobs`).
    logprobs: bool = False
    extra: dict[str, object] = field(default_factory=dict)


# --- parsing -----------------------------------------------------------------


@deep_is_refused
def parse_chat_request(body: bytes) -> ChatRequest:
    """Decode and validate a chat completions request body.

    Raises:
        RequestError: the body is not JSON, not an object, or breaks a rule of
            the API; `param` names the offending field (e.g. "messages[0].role").
    """
    # Decoded as plain values first, so the body's bounds hold before any field is
    # read (as for the other APIs), then converted to the wire Structs.
    return chat_request_from(decode_object(body))


def chat_request_from(obj: dict[str, Any]) -> ChatRequest:
    """Validate a chat completions request already decoded into JSON values.

    The other APIs (`edge.api.responses`, `edge.api.messages`) translate their
    requests into this shape, so every rule and limit of a chat request is theirs.
    Called inside their `deep_is_refused` parsers (a deep input is their 400).

    Raises:
        RequestError: as `parse_chat_request`.
    """
    return _build(wire_request(obj))


def _build(wire: WireRequest) -> ChatRequest:
    if not wire.model:
        raise invalid("model", "must be a non-empty string")
    check_chars(wire.model, "model", bounds.MAX_MODEL_CHARS)
    if not wire.messages:
        raise invalid("messages", "must contain at least one message")
    check_count(wire.messages, "messages", bounds.MAX_MESSAGES, "messages")
    messages = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(wire.messages))

    stream = bool(wire.stream)
    if wire.stream_options is not None and not stream:
        raise RequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    check_range(wire.temperature, "temperature", 0.0, 2.0)
    check_range(wire.top_p, "top_p", 0.0, 1.0, low_open=True)
    check_range(wire.presence_penalty, "presence_penalty", -2.0, 2.0)
    check_range(wire.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    check_range(wire.max_tokens, "max_tokens", 1, _MAX_TOKENS)
    check_range(wire.max_completion_tokens, "max_completion_tokens", 1, _MAX_TOKENS)
    check_range(wire.seed, "seed", *_INT64)
    if wire.n is not None and wire.n != 1:
        raise RequestError(f"Only n=1 is supported; got n={wire.n}.", param="n")
    check_choice(wire.reasoning_effort, "reasoning_effort", REASONING_EFFORTS)
    if wire.reasoning is not None:
        check_choice(wire.reasoning.effort, "reasoning.effort", REASONING_EFFORTS)
    metadata = wire.metadata or {}
    if len(metadata) > MAX_METADATA_KEYS:
        raise invalid("metadata", f"at most {MAX_METADATA_KEYS} keys; got {len(metadata)}")
    for key, value in metadata.items():
        check_chars(key, "metadata", bounds.MAX_METADATA_KEY_CHARS, "a key")
        check_chars(value, f"metadata.{key}", bounds.MAX_METADATA_VALUE_CHARS)
    if wire.user is not None:
        check_chars(wire.user, "user", bounds.MAX_USER_CHARS)
    if wire.prompt_cache_key is not None:
        check_chars(wire.prompt_cache_key, "prompt_cache_key", bounds.MAX_USER_CHARS)
    check_choice(wire.tool_validation, "tool_validation", _TOOL_VALIDATION)
    if wire.logit_bias is not None:
        check_count(wire.logit_bias, "logit_bias", bounds.MAX_LOGIT_BIAS, "entries")

    _check_logprobs(wire)

    include_reasoning, reasoning_explicit = _reasoning_flags(wire)
    return ChatRequest(
        model=wire.model,
        messages=messages,
        stream=stream,
        include_usage=bool(wire.stream_options and wire.stream_options.include_usage),
        tools=_tool_policy(wire),
        temperature=wire.temperature,
        top_p=wire.top_p,
        max_tokens=(
            wire.max_tokens if wire.max_completion_tokens is None else wire.max_completion_tokens
        ),
        stop=_stop(wire.stop),
        seed=wire.seed,
        presence_penalty=wire.presence_penalty,
        frequency_penalty=wire.frequency_penalty,
        response_format=_response_format(wire.response_format),
        metadata=metadata,
        user=wire.user,
        prompt_cache_key=wire.prompt_cache_key or None,
        service_tier=_service_tier(wire.service_tier),
        include_reasoning=include_reasoning,
        reasoning_explicit=reasoning_explicit,
        # OpenAI's top-level field, else OpenRouter's `reasoning.effort`.
        reasoning_effort=wire.reasoning_effort
        or (wire.reasoning.effort if wire.reasoning is not None else None),
        strict_output=wire.strict_output,
        stream_buffer=wire.stream_buffer,
        tool_validation=cast(ToolValidation | None, wire.tool_validation),
        trace_stream=metadata.get("trace_stream", "").strip().lower() in _TRUTHY,
        logprobs=bool(wire.logprobs),
        extra={name: value for name in EXTRA_FIELDS if (value := getattr(wire, name)) is not None},
    )


def _message(wire: WireMessage, at: str) -> ChatMessage:
    check_choice(wire.role, f"{at}.role", ROLES)
    role = cast(Role, wire.role)
    content = wire.content if isinstance(wire.content, str) else None
    parts = _parts(wire.content, at) if isinstance(wire.content, list) else ()
    if wire.tool_calls is not None:
        check_count(wire.tool_calls, f"{at}.tool_calls", bounds.MAX_MESSAGE_TOOL_CALLS, "calls")
    calls = tuple(
        _tool_call(c, f"{at}.tool_calls[{j}]") for j, c in enumerate(wire.tool_calls or ())
    )
    if content is None and not parts:
        if role != "assistant":
            raise missing(f"{at}.content", f"a {role} message needs a string or non-empty array")
        if not calls:
            raise invalid(f"{at}.content", "an assistant message needs content or tool_calls")
    if role == "tool" and wire.tool_call_id is None:
        raise missing(f"{at}.tool_call_id", "a tool message names the call it answers")
    if role == "function" and wire.name is None:
        raise missing(f"{at}.name", "a function message names its function")
    reasoning = None
    if role == "assistant":
        reasoning = wire.reasoning if wire.reasoning_content is None else wire.reasoning_content
    return ChatMessage(
        role=role,
        content=content,
        parts=parts,
        name=wire.name,
        tool_call_id=wire.tool_call_id,
        tool_calls=calls,
        reasoning_content=reasoning,
    )


def _parts(raw_parts: list[Any], at: str) -> tuple[ContentPart, ...]:
    """The message's parts; equal ones (a text, or a part of plain values) are one object.

    A part costs ~300 bytes as objects for as few as 13 of JSON; sharing the equal ones
    keeps a body of repeated small parts from holding 20 times its size.
    """
    check_count(raw_parts, f"{at}.content", bounds.MAX_CONTENT_PARTS, "parts")
    parts = []
    same: dict[object, ContentPart] = {}
    for j, raw in enumerate(raw_parts):
        if type(raw) is not dict:
            raise not_an_object(f"{at}.content[{j}]", raw)
        kind, text = raw.get("type"), raw.get("text", "")
        if not isinstance(kind, str):
            raise invalid(f"{at}.content[{j}].type", "each content part needs a string type")
        if kind != "text":
            text = ""
        elif not isinstance(text, str):
            raise invalid(f"{at}.content[{j}].text", "a text part needs a string text")
        key = _part_key(raw)
        part = same.get(key) if key is not None else None
        if part is None:
            part = ContentPart(type=kind, text=text, raw=raw)
            if key is not None:
                same[key] = part
        parts.append(part)
    return tuple(parts)


def _part_key(raw: dict[str, Any]) -> tuple[tuple[str, object], ...] | None:
    """What equal parts share (their items), or None for a part holding lists or objects."""
    items = tuple(raw.items())
    for _name, value in items:
        if type(value) not in (str, int, float, bool) and value is not None:
            return None
    return items


def _tool_call(wire: WireToolCall, at: str) -> ToolCall:
    if wire.type != "function":
        raise invalid(f"{at}.type", f"{wire.type!r}; only 'function' is supported")
    arguments = wire.function.arguments
    check_chars(arguments, f"{at}.function.arguments", bounds.MAX_TOOL_ARGUMENTS_CHARS)
    return ToolCall(id=wire.id, name=wire.function.name, arguments=arguments)


def _tool_policy(wire: WireRequest) -> ToolPolicy:
    # An empty list is no tools; without tools only "none" and "auto" are valid choices.
    specs = validate_tools(wire.tools) if wire.tools is not None else ()
    return ToolPolicy(
        tools=specs,
        choice=validate_tool_choice(wire.tool_choice, specs),
        parallel_tool_calls=wire.parallel_tool_calls is not False,
    )


def _reasoning_flags(wire: WireRequest) -> tuple[bool, bool]:
    """(include_reasoning, reasoning_explicit), as the stream semantics define them.

    Reasoning is included unless the caller turned it off in either dialect,
    and explicit when the caller asked for it in so many words.
    """
    flag = wire.include_reasoning
    exclude = wire.reasoning.exclude if wire.reasoning else None
    enabled = wire.reasoning.enabled if wire.reasoning else None
    include = not (flag is False or exclude is True or enabled is False)
    explicit = flag is True or exclude is False or enabled is True
    return include, explicit


def _service_tier(tier: str | None) -> str | None:
    """The tier asked for, None for none or "auto"; another value is a 400."""
    check_choice(tier, "service_tier", SERVICE_TIERS)
    return None if tier == "auto" else tier


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    elif len(stop) > MAX_STOP:
        raise invalid("stop", f"at most {MAX_STOP} sequences; got {len(stop)}")
    for sequence in stop:
        check_chars(sequence, "stop", bounds.MAX_STOP_CHARS, "a sequence")
    return tuple(stop)


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None:
        return None
    check_choice(fmt.get("type"), "response_format.type", RESPONSE_FORMATS, optional=False)
    if fmt["type"] == "json_schema":
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict):
            raise missing("response_format.json_schema", "an object with at least a name")
        if not isinstance(schema.get("name"), str) or not schema["name"]:
            raise invalid("response_format.json_schema.name", "must be a non-empty string")
        body = schema.get("schema")
        if body is not None:
            if not isinstance(body, dict):
                raise invalid("response_format.json_schema.schema", "must be a JSON Schema object")
            check_declared_schema(body, "response_format.json_schema.schema")
    return fmt


def _check_logprobs(wire: WireRequest) -> None:
    """top_logprobs: 0 to 20 (as OpenAI), and only with `logprobs: true`."""
    check_range(wire.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if wire.top_logprobs and not wire.logprobs:
        raise RequestError(
            "top_logprobs needs logprobs: set 'logprobs' to true to use 'top_logprobs'.",
            param="logprobs",
        )
