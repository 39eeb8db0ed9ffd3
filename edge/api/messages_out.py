"""Output events rendered as Anthropic's Messages API: stream events, or one Message.

The session's output events become content blocks: reasoning a `thinking`
block, visible text a `text` block, each tool call a `tool_use` block whose
input streams as one `input_json_delta`. A block stays open while its kind
of text keeps coming. The stream opens with `message_start` and ends with
`message_delta` (`stop_reason`, `stop_sequence`, usage) and `message_stop`, or
with one `event: error` carrying Anthropic's error object. Usage is counted as
Anthropic counts it: `input_tokens` without the cached ones. A node reports usage
only when its run ends, so `message_start` carries the prompt's tokens as the edge
estimates them (`prompt_tokens`, `edge.api.tokencount`), as Anthropic's own stream
gives the prompt's count there (clients that read input tokens only from it, such
as LangChain's, count them); `message_delta` carries the node's. Errors before the first
byte are HTTP errors in Anthropic's shape (`anthropic_error`), with the
status Anthropic gives their type.

Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, Final

import msgspec

from edge.stream.events import Usage
from edge.stream.output import (
    ContentOut,
    ErrorOut,
    FinishOut,
    OutEvent,
    ReasoningOut,
    ToolCallsOut,
)

_encode = msgspec.json.encode
PING: Final = b'event: ping\ndata: {"type":"ping"}\n\n'
# finish_reason -> stop_reason.
STOP_REASONS: Final = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
    "stop_sequence": "stop_sequence",
}
# Node finish reasons that mean a stop sequence matched (chat says `stop` for them).
_STOP_SEQUENCE: Final = frozenset({"stop_sequence"})
# The edge's HTTP status -> Anthropic's error type and status.
_BY_STATUS: Final = {
    400: ("invalid_request_error", 400),
    401: ("authentication_error", 401),
    403: ("permission_error", 403),
    404: ("not_found_error", 404),
    405: ("invalid_request_error", 405),
    413: ("request_too_large", 413),
    422: ("invalid_request_error", 422),
    429: ("rate_limit_error", 429),
}


def anthropic_error(status: int, edge_type: str, message: str) -> tuple[int, dict[str, Any]]:
    """An edge error as Anthropic's (status, body): `{"type": "error", "error": {...}}`.

    `overloaded` (every node slot taken) is Anthropic's 529 `overloaded_error`;
    another 4xx (a node's refusal) is `invalid_request_error` with its status;
    other server-side errors keep the edge's status as `api_error`. The message
    names the edge's own error type, so nothing of it is lost.
    """
    if edge_type == "overloaded":
        kind, status = "overloaded_error", 529
    elif status in _BY_STATUS:
        kind, status = _BY_STATUS[status]
    elif 400 <= status <= 499:  # another status of the request's fault (a node's refusal)
        kind = "invalid_request_error"
    else:
        kind = "api_error"
    text = message if edge_type in ("invalid_request_error", "") else f"{edge_type}: {message}"
    return status, {"type": "error", "error": {"type": kind, "message": text}}


def messages_usage(usage: Usage | None) -> dict[str, Any]:
    """Node usage as Anthropic counts it: `input_tokens` are the prompt tokens that were
    not read from the cache (a node's, like OpenAI's, count them all), so the prompt is
    `input_tokens + cache_read_input_tokens + cache_creation_input_tokens`. The node
    does not say which tokens it wrote to its cache: `cache_creation_input_tokens` is 0."""
    u = usage or Usage()
    cached = min(u.cached_input_tokens, u.input_tokens)
    return {
        "input_tokens": u.input_tokens - cached,
        "output_tokens": u.output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


class MessagesRenderer:
    """One answer's Messages rendering; `encode` for a stream, `add` + `response` for JSON."""

    keepalive: Final = PING

    def __init__(
        self, run_id: str, model: str, *, status_of: Callable[[str], int],
        stop_sequences: tuple[str, ...] = (), prompt_tokens: int = 0,
        service_tier: str | None = None,
    ) -> None:  # fmt: skip
        self.message_id = f"msg_{run_id}"
        self._model = model
        self._service_tier = service_tier  # its usage's (None: not said)
        self._status_of = status_of  # error type -> the edge's HTTP status
        self._stop_sequences = stop_sequences  # the request's
        self._prompt_tokens = prompt_tokens  # the edge's estimate, for message_start
        self._blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # "text" | "thinking" while a block is open
        self._text: list[str] = []
        self._frames: list[bytes] | None = None
        self._started = False
        self.finish: FinishOut | None = None
        self.error: ErrorOut | None = None

    def encode(self, events: Iterable[OutEvent]) -> bytes:
        self._frames = []
        self.add(events)
        frames, self._frames = self._frames, None
        return b"".join(frames)

    def add(self, events: Iterable[OutEvent]) -> None:
        for event in events:
            if not self._started:
                self._started = True
                usage = messages_usage(Usage(input_tokens=self._prompt_tokens))
                start = self._message(stop_reason=None, usage=usage)
                self._emit("message_start", message=start)
            if isinstance(event, ContentOut):
                if event.text:
                    self._delta("text", event.text)
            elif isinstance(event, ReasoningOut):
                if event.text:
                    self._delta("thinking", event.text)
            elif isinstance(event, ToolCallsOut):
                self._close()
                for call in event.calls:
                    self._tool_use(call.id, call.name, call.arguments)
            elif isinstance(event, FinishOut):
                self._close()
                self.finish = event
                usage = messages_usage(event.usage)
                delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
                self._emit("message_delta", delta=delta, usage=usage)
                self._emit("message_stop")
            elif isinstance(event, ErrorOut):
                self.error = event
                status = event.status or self._status_of(event.type)
                _, body = anthropic_error(status, event.type, event.message)
                self._emit("error", error=body["error"])

    @property
    def stop_reason(self) -> str | None:
        finish = self.finish
        if finish is None:
            return None
        if finish.finish_reason == "stop" and (
            finish.node_reason.strip().lower() in _STOP_SEQUENCE or self.stop_sequence is not None
        ):
            return "stop_sequence"  # told apart only by what the node says
        return STOP_REASONS.get(finish.finish_reason, "end_turn")

    @property
    def stop_sequence(self) -> str | None:
        """Which of the request's stop sequences ended the text: the one the node names
        (if it is one of them); else, when the node's finish reason says a stop sequence
        matched and the request has exactly one, that one; else None (as Anthropic, when
        the answer did not end on one, or the node does not say which of several)."""
        finish = self.finish
        if finish is None or finish.finish_reason != "stop":
            return None
        if finish.stop_sequence and finish.stop_sequence in self._stop_sequences:
            return finish.stop_sequence
        said = finish.node_reason.strip().lower() in _STOP_SEQUENCE
        if said and len(self._stop_sequences) == 1:
            return self._stop_sequences[0]
        return None

    def response(self) -> dict[str, Any]:
        """The whole Message (after a finish)."""
        finish = self.finish
        return self._message(
            stop_reason=self.stop_reason,
            usage=messages_usage(finish.usage if finish is not None else None),
            content=self._blocks,
            stop_sequence=self.stop_sequence,
        )

    def _message(
        self, *, stop_reason: str | None, usage: dict[str, Any],
        content: list[dict[str, Any]] | None = None, stop_sequence: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": content or [],
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage if self._service_tier is None else {
                **usage, "service_tier": self._service_tier,
            },
        }  # fmt: skip

    def _delta(self, kind: str, text: str) -> None:
        if self._open != kind:
            self._close()
            self._open = kind
            block: dict[str, Any] = (
                {"type": "text", "text": ""} if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )  # fmt: skip
            self._blocks.append(block)
            self._emit("content_block_start", index=len(self._blocks) - 1, content_block=block)
        if self._frames is None:  # a whole Message is being folded: its blocks' text
            self._text.append(text)
        delta = {"type": "text_delta", "text": text} if kind == "text" else {
            "type": "thinking_delta", "thinking": text}  # fmt: skip
        self._emit("content_block_delta", index=len(self._blocks) - 1, delta=delta)

    def _close(self) -> None:
        kind = self._open
        if kind is None:
            return
        self._open = None
        text = "".join(self._text)
        self._text = []
        block = {"type": "text", "text": text} if kind == "text" else {
            "type": "thinking", "thinking": text, "signature": ""}  # fmt: skip
        self._blocks[-1] = block
        self._emit("content_block_stop", index=len(self._blocks) - 1)

    def _tool_use(self, call_id: str, name: str, arguments: str) -> None:
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            value = {}
        tool_input = value if isinstance(value, dict) else {}
        if not isinstance(value, dict):  # an input is an object (report/off validation modes)
            arguments = "{}"
        index = len(self._blocks)
        self._blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": tool_input})
        start = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        self._emit("content_block_start", index=index, content_block=start)
        self._emit("content_block_delta", index=index,
                   delta={"type": "input_json_delta", "partial_json": arguments})  # fmt: skip
        self._emit("content_block_stop", index=index)

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._frames is None:
            return
        data = {"type": kind, **fields}
        self._frames.append(b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n")
