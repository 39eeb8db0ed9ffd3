"""Decode and validate a chat completions request body into a `ChatRequest`.

This module owns the request half of the OpenAI wire format: which fields a
request may carry, their types and ranges, and the 400 each malformed body
earns. msgspec decodes the JSON straight into wire Structs (so type errors
carry a JSON path); the rules msgspec cannot express follow in plain Python;
the result is frozen data. msgspec errors become `RequestError` exactly once,
here.

It must not know about nodes, routing, config defaults, HTTP or streams: bytes
in, values out (or a `RequestError`). No trio, quart, grpclib or asyncio.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar, cast, get_args

import msgspec

from edge.errors import RequestError
from edge.stream import bounds
from edge.stream.bounds import MAX_METADATA_KEYS, MAX_STOP
from edge.stream.logprobs import MAX_TOP_LOGPROBS
from edge.stream.toolcall import TOOL_VALIDATION_MODES, ToolCall, ToolPolicy, ToolValidation
from edge.stream.tools import check_declared_schema, validate_tool_choice, validate_tools

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]

ROLES: Final = frozenset(get_args(Role))
REASONING_EFFORTS: Final = frozenset({"minimal", "low", "medium", "high"})
RESPONSE_FORMATS: Final = frozenset({"text", "json_object", "json_schema"})
_TOOL_VALIDATION: Final = frozenset(TOOL_VALIDATION_MODES)
# Sampling extensions (vLLM / OpenRouter style) passed to the node as sent.
EXTRA_FIELDS: Final = (
    "top_k", "min_p", "repetition_penalty", "logit_bias", "logprobs", "top_logprobs",
    "ignore_eos", "min_tokens", "chat_template_kwargs",
)  # fmt: skip
_TRUTHY: Final = frozenset({"1", "true", "yes"})
# The node protocol carries max_tokens as uint32 and seed as int64.
_MAX_TOKENS: Final = 2**32 - 1
_INT64: Final = (-(2**63), 2**63 - 1)

_MALFORMED: Final = (
    "We could not parse the JSON body of your request. The API expects a JSON object "
    "(Content-Type: application/json), but what was sent was not valid JSON."
)


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

    def last_user_text(self) -> str:
        """The text of the last user message; "" when there is none."""
        for message in reversed(self.messages):
            if message.role == "user":
                return message.text()
        return ""


# --- the wire shape: what msgspec decodes into ----------------------------------


class _Wire(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True, gc=False):
    """Base of the wire Structs. Unknown fields are ignored, as vLLM does; None = absent."""


class _WireFunction(_Wire):
    name: str
    arguments: str


class _WireToolCall(_Wire):
    id: str
    function: _WireFunction
    type: str = "function"


class _WireMessage(_Wire):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[_WireToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _WireStreamOptions(_Wire):
    include_usage: bool | None = None


class _WireReasoning(_Wire):
    exclude: bool | None = None
    enabled: bool | None = None
    effort: str | None = None


class _WireRequest(_Wire):
    model: str
    messages: list[_WireMessage]
    stream: bool | None = None
    stream_options: _WireStreamOptions | None = None
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
    include_reasoning: bool | None = None
    reasoning: _WireReasoning | None = None
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


# --- parsing -----------------------------------------------------------------


TOO_DEEP: Final = (
    "The JSON body of your request is nested too deeply: objects and arrays may be nested "
    f"at most {bounds.MAX_JSON_DEPTH} levels deep."
)
TOO_MANY_VALUES: Final = (
    "The JSON body of your request holds too many values: the limit is "
    f"{bounds.MAX_JSON_VALUES} array elements and object members in all, at any depth."
)
_Parsed = TypeVar("_Parsed")


def deep_is_refused(parse: Callable[[bytes], _Parsed]) -> Callable[[bytes], _Parsed]:
    """A body parser whose too deeply nested input is a 400 naming the limit, never a
    500: past Python's recursion limit the decoder itself stops (the body never gets
    to `check_json_bounds`, which bounds every shallower one to MAX_JSON_DEPTH)."""

    @functools.wraps(parse)
    def guarded(body: bytes) -> _Parsed:
        try:
            return parse(body)
        except RecursionError:
            raise RequestError(TOO_DEEP) from None

    return guarded


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


def decode_object(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object within the body's bounds: where the body of
    every API enters (the first step of each parser, all `deep_is_refused`).

    Raises:
        RequestError: the body is not JSON, not an object, or past MAX_JSON_DEPTH or
            MAX_JSON_VALUES.
    """
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise RequestError(_MALFORMED) from None
    if not isinstance(value, dict):
        got = _TYPE_WORDS.get(_json_type(value), "a value")
        raise RequestError(f"The request body must be a JSON object, but got {got}.")
    check_json_bounds(value)
    return value


def check_json_bounds(value: object) -> None:
    """Decoded JSON `value` within MAX_JSON_DEPTH levels and MAX_JSON_VALUES values.

    One level at a time, without recursion: a level's values are counted (its
    containers' lengths, at C speed) before any of them is looked at, so the work
    is linear and stops at the first bound passed.

    Raises:
        RequestError: TOO_DEEP or TOO_MANY_VALUES.
    """
    level: list[Any] = [value] if type(value) is dict or type(value) is list else []
    depth = values = 0
    while level:
        depth += 1
        if depth > bounds.MAX_JSON_DEPTH:
            raise RequestError(TOO_DEEP)
        values += sum(map(len, level))
        if values > bounds.MAX_JSON_VALUES:
            raise RequestError(TOO_MANY_VALUES)
        level = [
            child
            for container in level
            for child in (container.values() if type(container) is dict else container)
            if type(child) is dict or type(child) is list
        ]


def _json_type(value: object) -> str:
    for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"),
                       (list, "array"), (type(None), "null")):  # fmt: skip
        if isinstance(value, kind):
            return name
    return "object"


def chat_request_from(obj: dict[str, Any]) -> ChatRequest:
    """Validate a chat completions request already decoded into JSON values.

    The other APIs (`edge.api.responses`, `edge.api.messages`) translate their
    requests into this shape, so every rule and limit of a chat request is theirs.
    Called inside their `deep_is_refused` parsers (a deep input is their 400).

    Raises:
        RequestError: as `parse_chat_request`.
    """
    try:
        wire = msgspec.convert(obj, _WireRequest)
    except msgspec.ValidationError as exc:
        raise _translate(str(exc)) from None
    return _build(wire)


def _build(wire: _WireRequest) -> ChatRequest:
    if not wire.model:
        raise _invalid("model", "must be a non-empty string")
    _check_chars(wire.model, "model", bounds.MAX_MODEL_CHARS)
    if not wire.messages:
        raise _invalid("messages", "must contain at least one message")
    _check_count(wire.messages, "messages", bounds.MAX_MESSAGES, "messages")
    messages = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(wire.messages))

    stream = bool(wire.stream)
    if wire.stream_options is not None and not stream:
        raise RequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    _check_range(wire.temperature, "temperature", 0.0, 2.0)
    _check_range(wire.top_p, "top_p", 0.0, 1.0, low_open=True)
    _check_range(wire.presence_penalty, "presence_penalty", -2.0, 2.0)
    _check_range(wire.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _check_range(wire.max_tokens, "max_tokens", 1, _MAX_TOKENS)
    _check_range(wire.max_completion_tokens, "max_completion_tokens", 1, _MAX_TOKENS)
    _check_range(wire.seed, "seed", *_INT64)
    if wire.n is not None and wire.n != 1:
        raise RequestError(f"Only n=1 is supported; got n={wire.n}.", param="n")
    _check_choice(wire.reasoning_effort, "reasoning_effort", REASONING_EFFORTS)
    if wire.reasoning is not None:
        _check_choice(wire.reasoning.effort, "reasoning.effort", REASONING_EFFORTS)
    metadata = wire.metadata or {}
    if len(metadata) > MAX_METADATA_KEYS:
        raise _invalid("metadata", f"at most {MAX_METADATA_KEYS} keys; got {len(metadata)}")
    for key, value in metadata.items():
        _check_chars(key, "metadata", bounds.MAX_METADATA_KEY_CHARS, "a key")
        _check_chars(value, f"metadata.{key}", bounds.MAX_METADATA_VALUE_CHARS)
    if wire.user is not None:
        _check_chars(wire.user, "user", bounds.MAX_USER_CHARS)
    _check_choice(wire.tool_validation, "tool_validation", _TOOL_VALIDATION)
    if wire.logit_bias is not None:
        _check_count(wire.logit_bias, "logit_bias", bounds.MAX_LOGIT_BIAS, "entries")

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


def _message(wire: _WireMessage, at: str) -> ChatMessage:
    _check_choice(wire.role, f"{at}.role", ROLES)
    role = cast(Role, wire.role)
    content = wire.content if isinstance(wire.content, str) else None
    parts = _parts(wire.content, at) if isinstance(wire.content, list) else ()
    if wire.tool_calls is not None:
        _check_count(wire.tool_calls, f"{at}.tool_calls", bounds.MAX_MESSAGE_TOOL_CALLS, "calls")
    calls = tuple(
        _tool_call(c, f"{at}.tool_calls[{j}]") for j, c in enumerate(wire.tool_calls or ())
    )
    if content is None and not parts:
        if role != "assistant":
            raise _missing(f"{at}.content", f"a {role} message needs a string or non-empty array")
        if not calls:
            raise _invalid(f"{at}.content", "an assistant message needs content or tool_calls")
    if role == "tool" and wire.tool_call_id is None:
        raise _missing(f"{at}.tool_call_id", "a tool message names the call it answers")
    if role == "function" and wire.name is None:
        raise _missing(f"{at}.name", "a function message names its function")
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


def _parts(raw_parts: list[dict[str, Any]], at: str) -> tuple[ContentPart, ...]:
    """The message's parts; equal ones (a text, or a part of plain values) are one object.

    A part costs ~300 bytes as objects for as few as 13 of JSON; sharing the equal ones
    keeps a body of repeated small parts from holding 20 times its size.
    """
    _check_count(raw_parts, f"{at}.content", bounds.MAX_CONTENT_PARTS, "parts")
    parts = []
    same: dict[object, ContentPart] = {}
    for j, raw in enumerate(raw_parts):
        kind, text = raw.get("type"), raw.get("text", "")
        if not isinstance(kind, str):
            raise _invalid(f"{at}.content[{j}].type", "each content part needs a string type")
        if kind != "text":
            text = ""
        elif not isinstance(text, str):
            raise _invalid(f"{at}.content[{j}].text", "a text part needs a string text")
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


def _tool_call(wire: _WireToolCall, at: str) -> ToolCall:
    if wire.type != "function":
        raise _invalid(f"{at}.type", f"{wire.type!r}; only 'function' is supported")
    arguments = wire.function.arguments
    _check_chars(arguments, f"{at}.function.arguments", bounds.MAX_TOOL_ARGUMENTS_CHARS)
    return ToolCall(id=wire.id, name=wire.function.name, arguments=arguments)


def _tool_policy(wire: _WireRequest) -> ToolPolicy:
    # An empty list is no tools; without tools only "none" and "auto" are valid choices.
    specs = validate_tools(wire.tools) if wire.tools is not None else ()
    return ToolPolicy(
        tools=specs,
        choice=validate_tool_choice(wire.tool_choice, specs),
        parallel_tool_calls=wire.parallel_tool_calls is not False,
    )


def _reasoning_flags(wire: _WireRequest) -> tuple[bool, bool]:
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


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    elif len(stop) > MAX_STOP:
        raise _invalid("stop", f"at most {MAX_STOP} sequences; got {len(stop)}")
    for sequence in stop:
        _check_chars(sequence, "stop", bounds.MAX_STOP_CHARS, "a sequence")
    return tuple(stop)


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None:
        return None
    _check_choice(fmt.get("type"), "response_format.type", RESPONSE_FORMATS, optional=False)
    if fmt["type"] == "json_schema":
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict):
            raise _missing("response_format.json_schema", "an object with at least a name")
        if not isinstance(schema.get("name"), str) or not schema["name"]:
            raise _invalid("response_format.json_schema.name", "must be a non-empty string")
        body = schema.get("schema")
        if body is not None:
            if not isinstance(body, dict):
                raise _invalid("response_format.json_schema.schema", "must be a JSON Schema object")
            check_declared_schema(body, "response_format.json_schema.schema")
    return fmt


def _check_logprobs(wire: _WireRequest) -> None:
    """top_logprobs: 0 to 20 (as OpenAI), and only with `logprobs: true`."""
    _check_range(wire.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if wire.top_logprobs and not wire.logprobs:
        raise RequestError(
            "top_logprobs needs logprobs: set 'logprobs' to true to use 'top_logprobs'.",
            param="logprobs",
        )


def _check_count(items: Sized, param: str, limit: int, what: str) -> None:
    """A list or map longer than its limit is a 400 naming the limit."""
    if len(items) > limit:
        raise _invalid(param, f"{len(items)} {what}; the limit is {limit} {what}")


def _check_chars(text: str, param: str, limit: int, what: str = "the value") -> None:
    """A string longer than its limit is a 400 naming the limit."""
    if len(text) > limit:
        raise _invalid(
            param, f"{what} is {len(text)} characters long; the limit is {limit} characters"
        )


def _check_range(
    value: float | None, param: str, low: float, high: float, *, low_open: bool = False
) -> None:
    if value is None or ((value > low if low_open else value >= low) and value <= high):
        return
    bound = f"greater than {low}" if low_open else f"at least {low}"
    raise _invalid(param, f"{value}; must be {bound} and at most {high}")


def _check_choice(
    value: object, param: str, allowed: frozenset[str], *, optional: bool = True
) -> None:
    if not ((value is None and optional) or (isinstance(value, str) and value in allowed)):
        expected = ", ".join(repr(v) for v in sorted(allowed))
        raise _invalid(param, f"{value!r}; expected one of {expected}")


def _invalid(param: str, why: str) -> RequestError:
    return RequestError(f"Invalid value for '{param}': {why}.", param=param)


def _missing(param: str, why: str) -> RequestError:
    return RequestError(f"Missing required parameter: '{param}' ({why}).", param=param)


# --- msgspec errors -> RequestError, once ---------------------------------------

_ERROR: Final = re.compile(r"(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?", re.DOTALL)
_MISSING: Final = re.compile(r"Object missing required field `(?P<name>[^`]+)`")
_EXPECTED: Final = re.compile(r"Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`")
_TYPE_WORDS: Final = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "object": "an object",
    "array": "an array",
    "null": "null",
}


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
        got = _TYPE_WORDS.get(expected["got"], expected["got"])
        if not param:
            return RequestError(f"The request body must be a JSON object, but got {got}.")
        want = [_TYPE_WORDS.get(t, f"`{t}`") for t in expected["want"].split(" | ")]
        wanted = want[0] if len(want) == 1 else f"one of {', '.join(want[:-1])} or {want[-1]}"
        return RequestError(
            f"Invalid type for '{param}': expected {wanted}, but got {got} instead.", param=param
        )
    if not param:
        return RequestError(f"Invalid request body: {detail}.")
    return _invalid(param, detail[:1].lower() + detail[1:])
