"""A RunRequest as the JSON body of an OpenAI-compatible `/chat/completions` request.

Pure: `chat_request_body` maps every field the contract carries to the
upstream's name for it, always streaming and asking for usage. Logprobs (in
extra_json) are forwarded as sent, `top_logprobs` capped at OpenAI's bound.

It must not know sockets, httpx, grpclib or asyncio, nor what the upstream answers
(that is `chunks` and `bodies`).
"""

from __future__ import annotations

import json
from typing import Any, Final

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.logprobs import MAX_TOP_LOGPROBS

__all__ = ["chat_request_body"]

# Fields the request body owns: extra_json may not override them.
_OWNED: Final = frozenset({"model", "messages", "stream", "stream_options", "cache_salt"})


def _content_part(part: Any) -> dict[str, Any]:
    if part.json:
        try:
            raw = json.loads(part.json)
        except ValueError:
            raw = None
        if isinstance(raw, dict):
            return raw
    return {"type": part.type or "text", "text": part.text}


def _message(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role}
    if message.content is not None:
        out["content"] = message.content
    elif message.parts:
        out["content"] = [_content_part(p) for p in message.parts]
    else:
        # OpenAI's shape: an assistant turn that only calls tools has null content.
        out["content"] = None if message.tool_calls else ""
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type or "function",
                "function": {"name": call.name, "arguments": call.arguments or "{}"},
            }
            for call in message.tool_calls
        ]
    return out


def _tool(tool: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        function["parameters"] = json.loads(tool.parameters_json)
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": tool.type or "function", "function": function}


def _tool_choice(choice: str) -> str | dict[str, Any]:
    if choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}


def chat_request_body(request: pb.RunRequest) -> dict[str, Any]:
    """Every field of `request` an OpenAI-compatible server understands, as its JSON body.

    Always streams and asks for usage. `extra_json` is merged in last but
    cannot replace the model, the messages, the streaming fields or the run's
    `cache_salt` (its KV-cache scope, vLLM's field: a caller naming another's would
    read that one's cache).
    """
    body: dict[str, Any] = {
        "model": request.model,
        "messages": [_message(m) for m in request.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.tools:
        body["tools"] = [_tool(t) for t in request.tools]
    if request.tool_choice:
        body["tool_choice"] = _tool_choice(request.tool_choice)
    optional = {
        "parallel_tool_calls": request.parallel_tool_calls,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_tokens": request.max_tokens,
        "seed": request.seed,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
    }
    body.update((k, v) for k, v in optional.items() if v is not None)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.response_format_json:
        body["response_format"] = json.loads(request.response_format_json)
    if request.metadata:
        body["metadata"] = dict(request.metadata)
    if request.extra_json:
        extra = json.loads(request.extra_json)
        if isinstance(extra, dict):
            body.update((k, v) for k, v in extra.items() if k not in _OWNED)
    top = body.get("top_logprobs")
    if isinstance(top, int) and not isinstance(top, bool) and top > MAX_TOP_LOGPROBS:
        body["top_logprobs"] = MAX_TOP_LOGPROBS
    if request.cache_salt:  # the run's KV-cache scope (vLLM's), never the caller's own
        body["cache_salt"] = request.cache_salt
    return body
