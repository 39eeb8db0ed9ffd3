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
    """A piece of the model's visible text."""

    text: str


# What one logprob entry (a token or an alternative) counts as, in characters of
# text, against the event buffer's bound (an entry costs ~150 bytes in memory).
LOGPROB_ENTRY_CHARS = 64


@dataclass(frozen=True, slots=True)
class LogprobDelta(Delta):
    """A delta with its tokens' logprobs (a subclass, so a plain Delta stays one field:
    building frozen dataclasses costs per field on the hot path)."""

    logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def size(self) -> int:
        """Its text's characters plus LOGPROB_ENTRY_CHARS per logprob entry."""
        return len(self.text) + LOGPROB_ENTRY_CHARS * sum(t.weight for t in self.logprobs)


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


NodeEvent = Delta | LogprobDelta | ReasoningDelta | Complete | Failed
