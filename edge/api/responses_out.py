"""Output events rendered as OpenAI's Responses API: stream events, or one Response.

The same session's output events (`edge.stream.output`) that chat renders as
chunks become output items here: reasoning text a `reasoning` item, visible
text a `message` item with one `output_text` part, each tool call a
`function_call` item (a call of a `custom` tool: a `custom_tool_call` item
with its `input`). A reasoning item carries its text as one `reasoning_text`
content part; when the request asked for a summary (`reasoning.summary`), as
one `summary_text` part of its `summary` instead (the reasoning itself stands
as its summary), with the summary events OpenAI sends. An item stays open
while its kind of text keeps coming and is closed (its `.done` events) when
another kind begins or the answer ends. The stream's events carry
`sequence_number`s from 0, open with `response.created` and
`response.in_progress`, and end with exactly one of `response.completed`,
`response.incomplete` (finish_reason `length` or `content_filter`) or
`response.failed` (an error), each with the whole Response. The
non-streaming answer is the same fold without the bytes.

Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Final

import msgspec

from edge.api.render import KEEPALIVE
from edge.api.responses import CUSTOM_INPUT
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
# finish_reason -> incomplete_details.reason; any other finish completes the response.
_INCOMPLETE: Final = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _error(error: ErrorOut | None) -> dict[str, Any] | None:
    """A failed Response's error: its code (a node's refusal's own, else the type)."""
    if error is None:
        return None
    return {"code": error.code or error.type, "message": error.message}


def responses_usage(usage: Usage | None) -> dict[str, Any]:
    """Node usage as a Response's usage."""
    u = usage or Usage()
    return {
        "input_tokens": u.input_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_input_tokens},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.input_tokens + u.output_tokens,
    }


class ResponsesRenderer:
    """One answer's Responses rendering; `encode` for a stream, `add` + `response` for JSON."""

    keepalive: Final = KEEPALIVE

    def __init__(self, run_id: str, created: int, model: str, echo: dict[str, Any]) -> None:
        self.response_id = f"resp_{run_id}"
        self._run_id = run_id
        self._created = created
        self._model = model
        self._echo = echo
        reasoning = echo.get("reasoning")
        # Reasoning as a summary: the request asked for one.
        self._summary = isinstance(reasoning, dict) and reasoning.get("summary") is not None
        self._custom = frozenset(  # the custom tools' names: their calls are custom_tool_calls
            t.get("name") for t in echo.get("tools") or () if t.get("type") == "custom"
        )
        self._seq = 0
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the message or reasoning item being written
        self._text: list[str] = []
        self._frames: list[bytes] | None = None
        self._started = False
        self.finish: FinishOut | None = None
        self.error: ErrorOut | None = None

    # --- the two renderings -----------------------------------------------------

    def encode(self, events: Iterable[OutEvent]) -> bytes:
        """The stream events of `events`, as SSE bytes (ready frames in one write)."""
        self._frames = []
        self.add(events)
        frames, self._frames = self._frames, None
        return b"".join(frames)

    def add(self, events: Iterable[OutEvent]) -> None:
        """Fold `events` into the answer (and its stream events, when encoding)."""
        for event in events:
            if not self._started:
                self._started = True
                snapshot = self._response("in_progress")
                self._emit("response.created", response=snapshot)
                self._emit("response.in_progress", response=snapshot)
            if isinstance(event, ContentOut):
                if event.text:
                    self._text_delta("message", event.text)
            elif isinstance(event, ReasoningOut):
                if event.text:
                    self._text_delta("reasoning", event.text)
            elif isinstance(event, ToolCallsOut):
                self._close()
                for call in event.calls:
                    if call.name in self._custom:
                        self._custom_call(call.id, call.name, call.arguments)
                    else:
                        self._function_call(call.id, call.name, call.arguments)
            elif isinstance(event, FinishOut):
                self._close()
                self.finish = event
                reason = _INCOMPLETE.get(event.finish_reason)
                if reason is None:
                    self._emit("response.completed", response=self.response())
                else:
                    self._emit("response.incomplete", response=self.response())
            elif isinstance(event, ErrorOut):
                self.error = event
                self._emit("response.failed", response=self.response())

    def response(self) -> dict[str, Any]:
        """The Response as it stands: completed, incomplete or failed once ended."""
        if self.error is not None:
            return self._response("failed")
        if self.finish is not None:
            status = "incomplete" if self.finish.finish_reason in _INCOMPLETE else "completed"
            return self._response(status)
        return self._response("in_progress")

    # --- items ------------------------------------------------------------------

    def _text_delta(self, kind: str, text: str) -> None:
        item = self._open
        if item is None or item["type"] != kind:
            self._close()
            item = self._open_item(kind)
        index = len(self._output) - 1
        self._text.append(text)
        if kind == "message":
            self._emit("response.output_text.delta", item_id=item["id"], output_index=index,
                       content_index=0, delta=text, logprobs=[])  # fmt: skip
        elif self._summary:
            self._emit("response.reasoning_summary_text.delta", item_id=item["id"],
                       output_index=index, summary_index=0, delta=text)  # fmt: skip
        else:
            self._emit("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                       content_index=0, delta=text)  # fmt: skip

    def _open_item(self, kind: str) -> dict[str, Any]:
        index = len(self._output)
        if kind == "message":
            item: dict[str, Any] = {
                "id": f"msg_{self._run_id}_{index}", "type": "message",
                "status": "in_progress", "role": "assistant", "content": [],
            }  # fmt: skip
        else:
            item = {"id": f"rs_{self._run_id}_{index}", "type": "reasoning", "summary": [],
                    "content": [], "status": "in_progress"}  # fmt: skip
            if self._summary:
                del item["content"]  # as OpenAI's summarized reasoning: no content
        self._output.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=index, item=_copy(item))
        if self._summarized(item):
            self._emit("response.reasoning_summary_part.added", item_id=item["id"],
                       output_index=index, summary_index=0, part=_summary(""))  # fmt: skip
        else:
            self._emit("response.content_part.added", item_id=item["id"], output_index=index,
                       content_index=0, part=_part(kind, ""))  # fmt: skip
        return item

    def _close(self) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        index = len(self._output) - 1
        text = "".join(self._text)
        self._text = []
        if self._summarized(item):
            summary = _summary(text)
            self._emit("response.reasoning_summary_text.done", item_id=item["id"],
                       output_index=index, summary_index=0, text=text)  # fmt: skip
            self._emit("response.reasoning_summary_part.done", item_id=item["id"],
                       output_index=index, summary_index=0, part=summary)  # fmt: skip
            item["summary"] = [summary]
            item["status"] = "completed"
            self._emit("response.output_item.done", output_index=index, item=_copy(item))
            return
        part = _part(item["type"], text)
        if item["type"] == "message":
            self._emit("response.output_text.done", item_id=item["id"], output_index=index,
                       content_index=0, text=text, logprobs=[])  # fmt: skip
        else:
            self._emit("response.reasoning_text.done", item_id=item["id"], output_index=index,
                       content_index=0, text=text)  # fmt: skip
        item["content"] = [part]
        item["status"] = "completed"
        self._emit("response.content_part.done", item_id=item["id"], output_index=index,
                   content_index=0, part=part)  # fmt: skip
        self._emit("response.output_item.done", output_index=index, item=_copy(item))

    def _function_call(self, call_id: str, name: str, arguments: str) -> None:
        index = len(self._output)
        item = {
            "id": f"fc_{self._run_id}_{index}", "type": "function_call",
            "status": "in_progress", "call_id": call_id, "name": name, "arguments": "",
        }  # fmt: skip
        self._output.append(item)
        self._emit("response.output_item.added", output_index=index, item=_copy(item))
        self._emit("response.function_call_arguments.delta", item_id=item["id"],
                   output_index=index, delta=arguments)  # fmt: skip
        self._emit("response.function_call_arguments.done", item_id=item["id"],
                   output_index=index, name=name, arguments=arguments)  # fmt: skip
        item["arguments"] = arguments
        item["status"] = "completed"
        self._emit("response.output_item.done", output_index=index, item=_copy(item))

    def _custom_call(self, call_id: str, name: str, arguments: str) -> None:
        """A custom tool's call: its freeform `input`, in one delta."""
        index = len(self._output)
        text = custom_input(arguments)
        item = {"id": f"ctc_{self._run_id}_{index}", "type": "custom_tool_call",
                "call_id": call_id, "name": name, "input": ""}  # fmt: skip
        self._output.append(item)
        self._emit("response.output_item.added", output_index=index, item=_copy(item))
        self._emit("response.custom_tool_call_input.delta", item_id=item["id"],
                   output_index=index, delta=text)  # fmt: skip
        self._emit("response.custom_tool_call_input.done", item_id=item["id"],
                   output_index=index, input=text)  # fmt: skip
        item["input"] = text
        self._emit("response.output_item.done", output_index=index, item=_copy(item))

    def _summarized(self, item: dict[str, Any]) -> bool:
        return self._summary and item["type"] == "reasoning"

    # --- the Response object and the frames ---------------------------------------

    def _response(self, status: str) -> dict[str, Any]:
        output = [_copy(item) for item in self._output]
        if self._open is not None and status != "in_progress":  # cut short by an error
            output[-1]["status"] = "incomplete"
            text = "".join(self._text)
            if self._summarized(self._open):
                output[-1]["summary"] = [_summary(text)]
            else:
                output[-1]["content"] = [_part(self._open["type"], text)]
        finish = self.finish
        incomplete = _INCOMPLETE.get(finish.finish_reason) if finish is not None else None
        error = self.error
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "error": _error(error),
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "model": self._model,
            "output": output,
            "usage": responses_usage(finish.usage) if finish is not None else None,
            **self._echo,
        }

    def _emit(self, kind: str, **fields: Any) -> None:
        seq = self._seq
        self._seq += 1
        if self._frames is None:
            return
        data = {"type": kind, "sequence_number": seq, **fields}
        self._frames.append(b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n")


def _part(kind: str, text: str) -> dict[str, Any]:
    """The one content part of a message or reasoning item."""
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _summary(text: str) -> dict[str, Any]:
    """The one part of a reasoning item's summary."""
    return {"type": "summary_text", "text": text}


def custom_input(arguments: str) -> str:
    """A custom tool's call as its freeform text: the `input` string of its function's
    arguments; a call the model wrote otherwise (let through by `report` or `off` tool
    validation) gives its one string value, else its arguments as written."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict):
        text = value.get(CUSTOM_INPUT)
        if isinstance(text, str):
            return text
        if len(value) == 1:
            (only,) = value.values()
            if isinstance(only, str):
                return only
    return arguments


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, list) else v for k, v in item.items()}
