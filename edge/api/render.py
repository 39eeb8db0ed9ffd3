"""Output events rendered as OpenAI's wire format: SSE chunks, or one response.

One session, two renderings: `SSEEncoder` turns output events into the bytes
of `chat.completion.chunk` frames; `ResponseBuilder` folds the same events
into one `chat.completion` object. The constant parts of every chunk are
encoded once per stream. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from edge.errors import error_object
from edge.stream.events import Usage
from edge.stream.logprobs import TokenLogprob, TopLogprob
from edge.stream.output import (
    ContentOut,
    ErrorOut,
    FinishOut,
    LogprobContentOut,
    OutEvent,
    ReasoningOut,
    RoleOut,
    ToolCallsOut,
)
from edge.stream.toolcall import ToolCall

_encode = msgspec.json.encode
DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


def usage_dict(usage: Usage | None) -> dict[str, Any]:
    """Node usage as OpenAI usage."""
    u = usage or Usage()
    return {
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_input_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


def tool_calls_list(calls: Iterable[ToolCall], *, indexed: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, call in enumerate(calls):
        item: dict[str, Any] = {"index": i} if indexed else {}
        item.update(
            id=call.id,
            type=call.type,
            function={"name": call.name, "arguments": call.arguments},
        )
        out.append(item)
    return out


# What OpenAI reports for a token too unlikely to have a finite log-probability.
_FLOOR_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR_LOGPROB


def _token_bytes(token: TopLogprob | TokenLogprob) -> list[int]:
    raw = token.token_bytes
    return list(raw if raw is not None else token.token.encode("utf-8", "replace"))


def logprobs_object(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's `choices[0].logprobs`: `{"content": [...], "refusal": null}`."""
    return {
        "content": [
            {
                "token": t.token,
                "logprob": _logprob(t.logprob),
                "bytes": _token_bytes(t),
                "top_logprobs": [
                    {"token": a.token, "logprob": _logprob(a.logprob), "bytes": _token_bytes(a)}
                    for a in t.top
                ],
            }
            for t in tokens
        ],
        "refusal": None,
    }


def error_frame(error_type: str, message: str, code: str | None = None) -> bytes:
    """A mid-stream error: the same OpenAI error object a JSON answer carries."""
    return b"data: " + _encode(error_object(error_type, message, code=code)) + b"\n\n"


class SSEEncoder:
    """Renders one stream's output events as SSE bytes."""

    __slots__ = ("_end", "_head", "_include_usage", "_tail", "_usage_head")

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        *,
        include_usage: bool,
        service_tier: str | None = None,
    ) -> None:
        common = (
            b'{"id":'
            + _encode(response_id)
            + b',"object":"chat.completion.chunk","created":'
            + str(created).encode()
            + b',"model":'
            + _encode(model)
        )
        if service_tier is not None:  # every chunk says it, as OpenAI's
            common += b',"service_tier":' + _encode(service_tier)
        self._head = b"data: " + common + b',"choices":[{"index":0,"delta":'
        # With include_usage, every chunk but the last carries "usage": null (as OpenAI's).
        self._end = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
        self._tail = b',"logprobs":null,"finish_reason":null}' + self._end
        self._usage_head = b"data: " + common + b',"choices":[],"usage":'
        self._include_usage = include_usage

    def encode(self, events: Iterable[OutEvent]) -> bytes:
        """All of `events` as one buffer (ready frames go out in one write)."""
        head, tail = self._head, self._tail
        parts: list[bytes] = []
        append = parts.append
        for event in events:
            kind = type(event)
            if kind is ContentOut:
                append(head + b'{"content":' + _encode(event.text) + b"}" + tail)  # type: ignore[union-attr]
            elif kind is ReasoningOut:
                append(head + b'{"reasoning_content":' + _encode(event.text) + b"}" + tail)  # type: ignore[union-attr]
            else:
                append(self._encode_rare(event))
        return b"".join(parts)

    def _encode_rare(self, event: OutEvent) -> bytes:
        if isinstance(event, LogprobContentOut):
            return (
                self._head
                + b'{"content":'
                + _encode(event.text)
                + b'},"logprobs":'
                + _encode(logprobs_object(event.logprobs))
                + b',"finish_reason":null}'
                + self._end
            )
        if isinstance(event, RoleOut):
            return self._head + b'{"role":"assistant"}' + self._tail
        if isinstance(event, ToolCallsOut):
            delta = {"tool_calls": tool_calls_list(event.calls, indexed=True)}
            return self._head + _encode(delta) + self._tail
        if isinstance(event, FinishOut):
            frame = (
                self._head
                + b'{},"logprobs":null,"finish_reason":'
                + _encode(event.finish_reason)
                + b"}"
                + self._end
            )
            if self._include_usage:
                frame += self._usage_head + _encode(usage_dict(event.usage)) + b"}\n\n"
            return frame + DONE
        if isinstance(event, ErrorOut):
            return error_frame(event.type, event.message, event.code)
        raise TypeError(f"not an output event: {event!r}")


class ResponseBuilder:
    """Folds output events into one `chat.completion` (the non-streaming rendering).

    `logprobs`: the request asked for them; the answer then carries every
    content token's, else `"logprobs": null`.
    """

    __slots__ = ("content", "error", "finish", "logprobs", "reasoning", "tool_calls")

    def __init__(self, *, logprobs: bool = False) -> None:
        self.content: list[str] = []
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self.reasoning: list[str] = []
        self.tool_calls: tuple[ToolCall, ...] = ()
        self.finish: FinishOut | None = None
        self.error: ErrorOut | None = None

    def add(self, events: Iterable[OutEvent]) -> None:
        for event in events:
            if isinstance(event, ContentOut):
                self.content.append(event.text)
                if self.logprobs is not None and isinstance(event, LogprobContentOut):
                    self.logprobs.extend(event.logprobs)
            elif isinstance(event, ReasoningOut):
                self.reasoning.append(event.text)
            elif isinstance(event, ToolCallsOut):
                self.tool_calls = event.calls
            elif isinstance(event, FinishOut):
                self.finish = event
            elif isinstance(event, ErrorOut):
                self.error = event

    def response(
        self, response_id: str, created: int, model: str, service_tier: str | None = None
    ) -> dict[str, Any]:
        assert self.finish is not None
        text = "".join(self.content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text if text or not self.tool_calls else None,
        }
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = tool_calls_list(self.tool_calls, indexed=False)
        tier = {} if service_tier is None else {"service_tier": service_tier}
        return {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            **tier,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None if self.logprobs is None else logprobs_object(self.logprobs),
                    "finish_reason": self.finish.finish_reason,
                }
            ],
            "usage": usage_dict(self.finish.usage),
        }
