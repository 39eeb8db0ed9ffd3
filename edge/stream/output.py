"""What a stream session produces: output events, and the outcome of a stream.

The session emits these; `edge.api` renders them as SSE chunks or folds them
into one non-streaming response. Nothing here knows about bytes or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from edge.stream.events import Usage
from edge.stream.logprobs import TokenLogprob
from edge.stream.toolcall import ToolCall, Violation


@dataclass(frozen=True, slots=True)
class RoleOut:
    """The opening chunk: `delta: {"role": "assistant"}`."""


@dataclass(frozen=True, slots=True)
class ContentOut:
    text: str


@dataclass(frozen=True, slots=True)
class LogprobContentOut(ContentOut):
    """Content of a request that asked for logprobs, with its tokens' (maybe none)."""

    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class ReasoningOut:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallsOut:
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class FinishOut:
    """Terminal success: the finish chunk, the usage chunk if asked, `[DONE]`.

    `node_reason`: the node's own finish reason, as it sent it (an API that tells
    more reasons apart than chat's five reads it, e.g. Anthropic's `stop_sequence`).
    `stop_sequence`: the stop sequence the node says ended the text (its `complete`
    metadata's `stop_sequence`), "" when it named none; the renderer believes it
    only when it is one of the request's."""

    finish_reason: str
    usage: Usage | None
    node_reason: str = field(default="", compare=False)
    stop_sequence: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class ErrorOut:
    """Terminal failure as the caller sees it: an error frame (or error response).

    `status`: the HTTP status it stands for when the type does not say it (a
    node's refusal, 4xx, or overload, 429: the node's status); 0: the type's
    (`edge.errors.status_of`). `code`: the error object's `code` (None: null)."""

    type: str
    message: str
    status: int = 0
    code: str | None = None


OutEvent = (
    RoleOut | ContentOut | LogprobContentOut | ReasoningOut | ToolCallsOut | FinishOut | ErrorOut
)

Status = Literal["success", "error", "cancelled", "timeout"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a stream ended, for metrics and logs; exactly one per session.

    `usage_sample` is False on the fail-stream path: a broken run stream
    produced no usable run, so no usage is recorded for it.
    """

    status: Status
    finish_reason: str | None = None
    error_type: str | None = None
    usage: Usage | None = None
    reasoning_chars: int = 0
    usage_sample: bool = True
    # The node's own finish_reason, as it sent it (None: the run did not complete);
    # `finish_reason` is what the caller got (edge.stream.finish).
    node_finish_reason: str | None = None
    # What the returned tool calls break (the report mode); counted and logged by the
    # HTTP layer, never here.
    tool_violations: tuple[Violation, ...] = ()
    # The HTTP status of the node's refusal (4xx) or overload (429) that ended the run
    # (`edge.stream.events.failure_class`); 0: neither.
    node_status: int = 0
