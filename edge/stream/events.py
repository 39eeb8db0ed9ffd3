"""Events from a node run, as the core sees them.

The node layer (`edge.node`) translates protobuf `RunEvent`s into these frozen
values; nothing else crosses the boundary. This module knows nothing of gRPC,
HTTP or the OpenAI wire format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from edge.stream.logprobs import TokenLogprob
from edge.stream.toolcall import ToolCall


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts a node reports for a run."""

    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_input_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Delta:
    """A piece of the model's visible text, and its tokens' logprobs when asked for."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """A piece of the model's reasoning."""

    text: str


@dataclass(frozen=True, slots=True)
class Complete:
    """The run finished.

    `tool_calls` are the model's native calls as the node typed them (an
    empty id means the node chose none). `metadata` holds `finish_reason`;
    a node older than the typed field sends its native calls there instead,
    as `tool_calls` (a JSON array), read only when `tool_calls` is empty.
    """

    usage: Usage | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class Failed:
    """The run ended with `error` or `cancelled` on the node's side."""

    kind: Literal["error", "cancelled"]
    error: str = ""
    message: str = ""
    usage: Usage | None = None

    @property
    def reason(self) -> str:
        """The text a caller sees: error, else message, else "run failed"."""
        return self.error or self.message or "run failed"


NodeEvent = Delta | ReasoningDelta | Complete | Failed
