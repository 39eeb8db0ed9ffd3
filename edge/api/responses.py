"""Decode a `POST /v1/responses` body into the one request every API runs: `ChatRequest`.

OpenAI's Responses API is translated, field by field, into a chat
completions request (input items -> messages, `instructions` -> a system
message, `text.format` -> `response_format`, ...), which `chat_request_from`
then validates: every rule and limit of a chat request holds here too, and
the run, the session and its guarantees are the same. What the Response
object repeats of the request (`echo`) is kept for the renderer
(`edge.api.responses_out`).

State (`edge.api.responses_state`): with a response store, `resolved` holds what
the store gave back for the body's references; `previous_response_id`'s items come
before this input, each `item_reference` is replaced by its item, and a request
with `store` true (the default) carries its context (`store_context`, JSON) for its
answer to be stored with. Without one (`resolved` None), `previous_response_id`
and `item_reference` items are refused with a 400 saying the edge keeps no state,
and nothing is stored. `conversation` is always refused. Hosted tools the edge
cannot run (`web_search`, `file_search`, ...) are dropped (`dropped` says which).
A `custom` (freeform) tool is declared to the node as a function tool taking
one string, `input`; its calls are rendered back as `custom_tool_call` items
(`edge.api.responses_out`), and its earlier calls and outputs in `input` are
that function's.

Pure: bytes in, values out (or a `RequestError`). No HTTP, no trio.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from edge.api.request import ChatRequest, chat_request_from, decode_object, deep_is_refused
from edge.api.responses_state import Resolved, as_items, history, with_items
from edge.errors import RequestError
from edge.observe.logbound import Mentions, clip_repr

STATELESS: Final = (
    "This edge keeps no state between requests: '{param}' is not supported. Send the "
    "whole conversation in 'input' instead."
)
# Roles of input messages, as chat roles.
_ROLES: Final = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text", "summary_text",
                                "reasoning_text"})  # fmt: skip
# Reasoning efforts beyond chat's four, as the nearest of them (None: send none).
_EFFORTS: Final[dict[str, str | None]] = {"none": None, "xhigh": "high"}
_SUMMARIES: Final = ("auto", "concise", "detailed")
_TRUNCATIONS: Final = ("auto", "disabled")
# A custom tool's one parameter: the freeform text the model writes (OpenAI's `input`).
CUSTOM_INPUT: Final = "input"
_CUSTOM_PARAMETERS: Final = {
    "type": "object",
    "properties": {CUSTOM_INPUT: {"type": "string"}},
    "required": [CUSTOM_INPUT],
    "additionalProperties": False,
}


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated Responses request: the run's request, and what the answer repeats."""

    chat: ChatRequest
    echo: dict[str, Any] = field(default_factory=dict)
    # Accepted but not used (hosted tools), for a log line.
    dropped: tuple[str, ...] = ()
    # The items this response is given (earlier turns' and this input), as a JSON
    # array, when its answer is to be stored; None: it is not.
    store_context: bytes | None = None


@deep_is_refused
def parse_responses_request(body: bytes, resolved: Resolved | None = None) -> ResponsesRequest:
    """Decode, translate and validate a Responses request body; `resolved`: what the
    response store holds of its references (None: the edge keeps no state).

    Raises:
        RequestError: the body breaks a rule of the API (or of chat requests), or
            (NotFoundError) refers to a response or item the store does not hold.
    """
    obj = decode_object(body)
    store = _store(obj, stateful=resolved is not None)
    dropped = Mentions()
    chat: dict[str, Any] = {"model": obj.get("model")}
    context, given, chat["messages"] = _messages(obj, resolved)
    for name in (
        "stream", "temperature", "top_p", "metadata", "parallel_tool_calls", "prompt_cache_key",
        "service_tier",
    ):  # fmt: skip
        if obj.get(name) is not None:
            chat[name] = obj[name]
    if obj.get("max_output_tokens") is not None:
        chat["max_tokens"] = obj["max_output_tokens"]
    user = obj.get("user", obj.get("safety_identifier"))
    if user is not None:
        chat["user"] = user
    tools = obj.get("tools")
    echoed: list[dict[str, Any]] = []
    if tools is not None:
        chat["tools"], echoed = _tools(tools, dropped)
    if obj.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(obj["tool_choice"])
    _text_and_reasoning(obj, chat)
    _one_of(obj.get("truncation"), _TRUNCATIONS, "truncation")
    request = chat_request_from(chat)
    stored = resolved is not None and store is not False
    return ResponsesRequest(
        chat=request,
        echo=_echo(obj, echoed, stored=stored),
        dropped=dropped.notes(),
        store_context=msgspec.json.encode([*context, *as_items(given)]) if stored else None,
    )


def _store(obj: dict[str, Any], *, stateful: bool) -> bool | None:
    """The body's `store`, once what asks for state the edge does not keep is refused:
    `conversation`, `background`, and without a response store `previous_response_id`."""
    stateless = ("conversation",) if stateful else ("previous_response_id", "conversation")
    for param in stateless:
        if obj.get(param) is not None:
            raise RequestError(STATELESS.format(param=param), param=param)
    store = obj.get("store", True)
    if store is not None and not isinstance(store, bool):
        raise _type("store", "a boolean")
    if obj.get("background") is True:
        raise RequestError(
            "Background responses are not supported: this edge keeps no state.",
            param="background",
        )
    return store


def _messages(
    obj: dict[str, Any], resolved: Resolved | None
) -> tuple[list[Any], Any, list[dict[str, Any]]]:
    """The chat messages: `instructions`, the earlier turns' items the store gave back,
    then `input` (its item references replaced). Returned with those earlier items and
    that input: the stored context is made of them."""
    messages: list[dict[str, Any]] = []
    instructions = obj.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _type("instructions", "a string")
        messages.append({"role": "system", "content": instructions})
    if "input" not in obj:
        raise RequestError("Missing required parameter: 'input'.", param="input")
    given = obj["input"]
    context: list[Any] = []
    if resolved is not None:
        context = history(resolved, obj.get("previous_response_id"))
        given = with_items(given, resolved)
        if context:
            messages.extend(_input(context))
    messages.extend(_input(given))
    return context, given, messages


def _text_and_reasoning(obj: dict[str, Any], chat: dict[str, Any]) -> None:
    """`text.format` as `response_format`, `reasoning.effort` as `reasoning_effort`."""
    text = obj.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise _type("text", "an object")
        fmt = _text_format(text.get("format"))
        if fmt is not None:
            chat["response_format"] = fmt
    reasoning = obj.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _type("reasoning", "an object")
        effort = reasoning.get("effort")
        effort = _EFFORTS.get(effort, effort) if isinstance(effort, str) else effort
        if effort is not None:
            chat["reasoning_effort"] = effort
        _one_of(reasoning.get("summary"), _SUMMARIES, "reasoning.summary")


def _echo(obj: dict[str, Any], tools: list[dict[str, Any]], *, stored: bool) -> dict[str, Any]:
    """The request fields a Response object repeats, with OpenAI's defaults. `tools`: the
    tools declared, as the Response lists them (a custom tool as a custom tool: the
    renderer renders its calls by it). `truncation` is repeated as asked: the edge never
    truncates either way (a prompt too long is the node's refusal). `stored`: whether the
    response is kept for later requests."""
    reasoning = obj["reasoning"] if isinstance(obj.get("reasoning"), dict) else {}
    text = obj["text"] if isinstance(obj.get("text"), dict) else {}
    return {
        "instructions": obj.get("instructions"),
        "max_output_tokens": obj.get("max_output_tokens"),
        "metadata": obj.get("metadata") or {},
        "parallel_tool_calls": obj.get("parallel_tool_calls", True),
        "previous_response_id": obj.get("previous_response_id"),  # None unless resolved
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": stored,
        "temperature": obj.get("temperature", 1.0),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": obj.get("tool_choice", "auto"),
        "tools": tools,
        "top_p": obj.get("top_p", 1.0),
        "truncation": obj.get("truncation") or "disabled",
        "user": obj.get("user"),
    }


# --- input items -> messages ----------------------------------------------------


def _input(value: object) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise _type("input", "a string or an array of items")
    if not value:
        raise RequestError("Invalid value for 'input': must not be empty.", param="input")
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items, for the next assistant message
    for i, item in enumerate(value):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise _type(at, "an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _message(item, at)
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"] = "".join(reasoning)
                reasoning.clear()
            messages.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = _string(item, "call_id", at), _string(item, "name", at)
            if kind == "function_call":
                arguments = _string(item, "arguments", at)
            else:  # a custom tool's call: its function's one argument
                arguments = json.dumps({CUSTOM_INPUT: _string(item, "input", at)})
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn: text, then calls
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"] = "".join(reasoning)
                    reasoning.clear()
                messages.append(message)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            content: object = output
            if isinstance(output, list):
                content = _parts(output, f"{at}.output")
            elif not isinstance(output, str):
                raise _type(f"{at}.output", "a string or an array of content parts")
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", at), "content": content}
            )
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item, at))
        elif kind == "item_reference":
            raise RequestError(STATELESS.format(param=f"{at}.type"), param=f"{at}.type")
        else:
            raise RequestError(
                f"Invalid value for '{at}.type': {kind!r}; supported input items are "
                "'message', 'function_call', 'function_call_output', 'custom_tool_call', "
                "'custom_tool_call_output' and 'reasoning'.",
                param=f"{at}.type",
            )
    return messages


def _message(item: dict[str, Any], at: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        expected = ", ".join(repr(r) for r in sorted(_ROLES))
        raise RequestError(
            f"Invalid value for '{at}.role': {role!r}; expected one of {expected}.",
            param=f"{at}.role",
        )
    content = item.get("content")
    if isinstance(content, list):
        return {"role": role, "content": _parts(content, f"{at}.content")}
    if not isinstance(content, str):
        raise _type(f"{at}.content", "a string or an array of content parts")
    return {"role": role, "content": content}


def _parts(parts: list[Any], at: str) -> list[dict[str, Any]]:
    """Responses content parts as chat content parts (images as `image_url`)."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise _type(f"{at}[{j}]", "an object")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            out.append({"type": "text", "text": _string(part, "text", f"{at}[{j}]")})
        elif kind == "refusal":
            out.append({"type": "text", "text": _string(part, "refusal", f"{at}[{j}]")})
        elif kind == "input_image":
            image: dict[str, Any] = {"url": part.get("image_url") or part.get("file_id")}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            out.append({"type": "image_url", "image_url": image})
        else:
            out.append(part)  # passed to the node as sent (input_file, input_audio, ...)
    return out


def _reasoning_text(item: dict[str, Any], at: str) -> str:
    texts: list[str] = []
    for name in ("content", "summary"):
        parts = item.get(name)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise _type(f"{at}.{name}", "an array")
        texts.extend(
            p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
        if texts:
            break  # the full text when present, else its summary
    return "".join(texts)


# --- tools, tool_choice, text.format ---------------------------------------------


def _tools(tools: object, dropped: Mentions) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The chat tools declared to the node, and the tools as the Response repeats them."""
    if not isinstance(tools, list):
        raise _type("tools", "an array")
    out: list[dict[str, Any]] = []
    echoed: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _type(f"tools[{i}]", "an object")
        kind = tool.get("type")
        # A namespace groups tools (Codex CLI): declared one by one.
        group = tool["tools"] if kind == "namespace" and isinstance(tool.get("tools"), list) \
            else [tool]  # fmt: skip
        declared = [t for t in group if isinstance(t, dict) and t.get("type") in _DECLARED]
        if not declared:
            what = "holds no function or custom tool" if kind == "namespace" else "a hosted tool"
            dropped.add(f"tools[{i}] (type {clip_repr(kind, 64)}: {what})")
        for t in declared:
            out.append(_function_tool(t) if t["type"] == "function" else _custom_tool(t))
            echoed.append(_echoed_tool(t))
    return out, echoed


# Tool types declared to the node (of a namespace, these; any other is dropped).
_DECLARED: Final = frozenset({"function", "custom"})


def _function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}  # fmt: skip
    return {"type": "function", "function": function}


def _custom_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A custom (freeform) tool as a function of one string, `input`; a grammar its input
    must follow is told in the description (the node has no grammar to hold it to)."""
    description = tool.get("description")
    description = description if isinstance(description, str) else ""
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if isinstance(syntax, str) and isinstance(definition, str):
            told = f"The input follows this {syntax} grammar:\n{definition}"
            description = f"{description}\n\n{told}" if description else told
    function: dict[str, Any] = {"name": tool.get("name"), "parameters": _CUSTOM_PARAMETERS}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool["type"] == "function":
        return {"type": "function", **_function_tool(tool)["function"]}
    return {k: tool[k] for k in ("type", "name", "description", "format") if k in tool}


def _tool_choice(choice: object) -> object:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise RequestError(
        "Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or "
        '{"type": "function", "name": ...}; hosted tools are not supported.',
        param="tool_choice",
    )


def _text_format(fmt: object) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _type("text.format", "an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(
        f"Invalid value for 'text.format.type': {kind!r}; expected 'text', 'json_object' "
        "or 'json_schema'.",
        param="text.format.type",
    )


def _one_of(value: object, allowed: tuple[str, ...], param: str) -> None:
    if value is not None and value not in allowed:
        expected = ", ".join(repr(a) for a in allowed)
        raise RequestError(
            f"Invalid value for '{param}': {clip_repr(value, 64)}; expected one of {expected}.",
            param=param,
        )


def _string(obj: dict[str, Any], name: str, at: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        if value is None:
            raise RequestError(f"Missing required parameter: '{at}.{name}'.", param=f"{at}.{name}")
        raise _type(f"{at}.{name}", "a string")
    return value


def _type(param: str, wanted: str) -> RequestError:
    return RequestError(f"Invalid type for '{param}': expected {wanted}.", param=param)
