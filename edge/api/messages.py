"""Decode a `POST /v1/messages` body (Anthropic's Messages API) into a `ChatRequest`.

Anthropic's request is translated into a chat completions request (`system`
-> a system message, content blocks -> content parts, `tool_use` blocks ->
tool calls, `tool_result` blocks -> tool messages (`is_error: true`: its
content after `Error: `), `input_schema` ->
`parameters`, `thinking` -> whether reasoning is exposed), which
`chat_request_from` validates: every rule and limit of a chat request holds
here too. `max_tokens` is required, as Anthropic requires it. `service_tier`:
"auto" is the key's default tier, "standard_only" the default tier.

Accepted and ignored, as the agents send them: `cache_control`,
`context_management`, `defer_loading`, `container`; server
tools (a `type` other than `custom`) are dropped (`dropped` says which).

Pure: bytes in, values out (or a `RequestError`). No HTTP, no trio.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from edge.api.request import ChatRequest, chat_request_from, decode_object, deep_is_refused
from edge.errors import RequestError
from edge.observe.logbound import Mentions, clip_repr

_ROLES: Final = frozenset({"user", "assistant", "system"})
_SERVICE_TIERS: Final = {"auto": "auto", "standard_only": "default"}
# output_config.effort -> reasoning effort.
_EFFORTS: Final = {"low": "low", "medium": "medium", "high": "high", "max": "high"}
# Blocks carried as they are to the node (a part of the message's content).
_PASSED: Final = frozenset({"document", "search_result"})
# Blocks that say nothing the model needs again.
_IGNORED: Final = frozenset({"redacted_thinking"})
# What a `tool_result` with `is_error: true` starts with, for the model.
ERROR_PREFIX: Final = "Error: "


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A validated Messages request, as the run's request."""

    chat: ChatRequest
    # thinking is on: reasoning is rendered as `thinking` blocks.
    thinking: bool = False
    dropped: tuple[str, ...] = ()


@deep_is_refused
def parse_messages_request(body: bytes) -> MessagesRequest:
    """Decode, translate and validate a Messages request body.

    Raises:
        RequestError: the body breaks a rule of the API (or of chat requests).
    """
    return messages_request_from(decode_object(body))


def messages_request_from(obj: dict[str, Any], *, counting: bool = False) -> MessagesRequest:
    """Translate and validate a Messages request already decoded into JSON values.

    `counting`: the body of `POST /v1/messages/count_tokens`, which has no
    `max_tokens` (a count's request is the Messages request without it).
    Called inside a `deep_is_refused` parser (a deep input is its 400).

    Raises:
        RequestError: as `parse_messages_request`.
    """
    if counting:
        obj = {**obj, "max_tokens": 1}  # nothing is generated: any valid value will do
    if obj.get("max_tokens") is None:
        raise RequestError("max_tokens: Field required", param="max_tokens")
    if "messages" not in obj:
        raise RequestError("messages: Field required", param="messages")
    dropped = Mentions()
    chat: dict[str, Any] = {"model": obj.get("model"), "max_tokens": obj["max_tokens"]}
    messages: list[dict[str, Any]] = []
    system = obj.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _system_text(system, "system")})
    raw = obj["messages"]
    if not isinstance(raw, list):
        raise _type("messages", "an array")
    for i, message in enumerate(raw):
        messages.extend(_message(message, f"messages[{i}]"))
    chat["messages"] = messages
    for name in ("stream", "temperature", "top_p", "top_k"):
        if obj.get(name) is not None:
            chat[name] = obj[name]
    if obj.get("service_tier") is not None:
        chat["service_tier"] = _service_tier(obj["service_tier"])
    if obj.get("stop_sequences") is not None:
        chat["stop"] = obj["stop_sequences"]
    metadata = obj.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    tools = obj.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools, dropped)
    parallel = True
    choice = obj.get("tool_choice")
    if choice is not None:
        chat["tool_choice"], parallel = _tool_choice(choice)
        if not parallel:
            chat["parallel_tool_calls"] = False
    thinking = _thinking(obj.get("thinking"))
    chat["reasoning"] = {"enabled": thinking}
    config = obj.get("output_config")
    if isinstance(config, dict) and config.get("effort") is not None:
        effort = config["effort"]
        if effort not in _EFFORTS:
            raise RequestError(
                f"output_config.effort: {effort!r} is not one of 'low', 'medium', 'high', 'max'",
                param="output_config.effort",
            )
        chat["reasoning_effort"] = _EFFORTS[effort]
    return MessagesRequest(chat_request_from(chat), thinking=thinking, dropped=dropped.notes())


def _thinking(value: object) -> bool:
    """Whether reasoning is exposed: `enabled`, or `adaptive` unless its display is omitted."""
    if value is None:
        return False
    if not isinstance(value, dict):
        raise _type("thinking", "an object")
    kind = value.get("type")
    if kind == "enabled":
        return True
    if kind == "adaptive":
        return value.get("display") != "omitted"
    if kind == "disabled":
        return False
    raise RequestError(
        f"thinking.type: {kind!r} is not one of 'enabled', 'adaptive', 'disabled'",
        param="thinking.type",
    )


def _service_tier(tier: object) -> str:
    """Anthropic's `service_tier` as the chat request's: "auto" is the key's default,
    "standard_only" the default tier."""
    if not isinstance(tier, str) or tier not in _SERVICE_TIERS:
        raise RequestError(
            f"service_tier: {tier!r} is not one of 'auto', 'standard_only'", param="service_tier"
        )
    return _SERVICE_TIERS[tier]


def _system_text(value: object, at: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _type(at, "a string or an array of text blocks")
    texts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise RequestError(f"{at}.{j}: only text blocks are allowed here", param=f"{at}.{j}")
        texts.append(_string(block, "text", f"{at}.{j}"))
    return "\n".join(texts)


def _message(message: object, at: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results first, each its own message."""
    if not isinstance(message, dict):
        raise _type(at, "an object")
    role = message.get("role")
    if role not in _ROLES:
        raise RequestError(
            f"{at}.role: {role!r} is not one of 'user', 'assistant', 'system'", param=f"{at}.role"
        )
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "system":
        return [{"role": role, "content": _system_text(content, f"{at}.content")}]
    if not isinstance(content, list):
        raise _type(f"{at}.content", "a string or an array of content blocks")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(content):
        where = f"{at}.content.{j}"
        if not isinstance(block, dict):
            raise _type(where, "an object")
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _string(block, "text", where)})
        elif kind == "image":
            parts.append(_image(block, where))
        elif kind == "tool_use" and role == "assistant":
            calls.append({
                "id": _string(block, "id", where), "type": "function",
                "function": {"name": _string(block, "name", where),
                             "arguments": json.dumps(block.get("input", {}))},
            })  # fmt: skip
        elif kind == "tool_result" and role == "user":
            result = _result_content(block.get("content", ""), f"{where}.content")
            if _is_error(block, where):
                result = _as_error(result)
            out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
                        "content": result})  # fmt: skip
        elif kind == "thinking" and role == "assistant":
            thinking.append(_string(block, "thinking", where))
        elif kind in _PASSED:
            parts.append(block)
        elif kind in _IGNORED:
            continue
        else:
            raise RequestError(
                f"{where}.type: {kind!r} is not a supported content block in a {role} message",
                param=f"{where}.type",
            )
    if role == "assistant":
        text = "".join(p["text"] for p in parts if p.get("type") == "text")
        message_out: dict[str, Any] = {
            "role": "assistant",
            "content": text if text or not calls else None,
        }
        if calls:
            message_out["tool_calls"] = calls
        if thinking:
            message_out["reasoning_content"] = "".join(thinking)
        out.append(message_out)
    elif parts or not out:
        out.append({"role": role, "content": parts or ""})
    return out


def _image(block: dict[str, Any], at: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise _type(f"{at}.source", "an object")
    if source.get("type") == "base64":
        media = _string(source, "media_type", f"{at}.source")
        url = f"data:{media};base64,{_string(source, 'data', f'{at}.source')}"
    elif source.get("type") == "url":
        url = _string(source, "url", f"{at}.source")
    else:
        return block  # passed to the node as sent (a file id, ...)
    return {"type": "image_url", "image_url": {"url": url}}


def _result_content(value: object, at: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _type(at, "a string or an array of content blocks")
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(value):
        if not isinstance(block, dict):
            raise _type(f"{at}.{j}", "an object")
        if block.get("type") == "text":
            parts.append({"type": "text", "text": _string(block, "text", f"{at}.{j}")})
        elif block.get("type") == "image":
            parts.append(_image(block, f"{at}.{j}"))
        else:
            parts.append(block)
    return parts or ""


def _is_error(block: dict[str, Any], at: str) -> bool:
    value = block.get("is_error")
    if value is not None and not isinstance(value, bool):
        raise _type(f"{at}.is_error", "a valid boolean")
    return value is True


def _as_error(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A failed tool's result as the model reads it: its text after `ERROR_PREFIX`. A chat
    tool message has no error flag, and neither LiteLLM nor vLLM carries it (they drop
    it); the model is told in the words tool frameworks use for a failed call."""
    if isinstance(content, str):
        return ERROR_PREFIX + content if content else ERROR_PREFIX.rstrip()
    first = content[0] if content else None
    if first is not None and first.get("type") == "text" and isinstance(first.get("text"), str):
        return [{**first, "text": ERROR_PREFIX + first["text"]}, *content[1:]]
    return [{"type": "text", "text": ERROR_PREFIX.rstrip()}, *content]


def _tools(tools: object, dropped: Mentions) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _type("tools", "an array")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _type(f"tools.{i}", "an object")
        if tool.get("type", "custom") != "custom":
            dropped.add(f"tools.{i} (type {clip_repr(tool.get('type'), 64)}: a server tool)")
            continue
        function: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("input_schema") is not None:
            function["parameters"] = tool["input_schema"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object) -> tuple[object, bool]:
    """(chat tool_choice, parallel tool calls allowed)."""
    if not isinstance(choice, dict):
        raise _type("tool_choice", "an object")
    parallel = choice.get("disable_parallel_tool_use") is not True
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise RequestError(
        f"tool_choice.type: {kind!r} is not one of 'auto', 'any', 'tool', 'none'",
        param="tool_choice.type",
    )


def _string(obj: dict[str, Any], name: str, at: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        if value is None:
            raise RequestError(f"{at}.{name}: Field required", param=f"{at}.{name}")
        raise _type(f"{at}.{name}", "a string")
    return value


def _type(param: str, wanted: str) -> RequestError:
    return RequestError(f"{param}: Input should be {wanted}", param=param)
