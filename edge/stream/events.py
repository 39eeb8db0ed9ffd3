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


# The longest machine-readable code of a refusal the caller is shown (`Failed.code`).
MAX_CODE_CHARS = 64
_CODE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-")


def failure_class(kind: str, http_status: int) -> Literal["refused", "overloaded", "failed"]:
    """What an ended run says, by the HTTP status its node gave (the contract's table).

    An `error` with 400-499 but 408 and 429 is a refusal: the request is at
    fault (the node is fine; another node would answer the same). 429: the node
    is overloaded (another node may take the run). Anything else (no status, 408,
    5xx, a status that is no HTTP error, a `cancelled` run) is the node's failure.
    """
    if kind != "error" or not 400 <= http_status <= 499 or http_status == 408:
        return "failed"
    return "overloaded" if http_status == 429 else "refused"


@dataclass(frozen=True, slots=True)
class Failed:
    """The run ended with `error` or `cancelled` on the node's side.

    `http_status`: the status the node's model server gave for an `error`
    (0: none); `failure_class` says what it makes of the run. A refusal's
    (or an overload's) `error` may be a machine-readable code and its
    `message` the model server's own words (`code`, `words`)."""

    kind: Literal["error", "cancelled"]
    error: str = ""
    message: str = ""
    usage: Usage | None = None
    http_status: int = 0

    @property
    def reason(self) -> str:
        """The text a caller sees: error, else message, else "run failed"."""
        return self.error or self.message or "run failed"

    @property
    def words(self) -> str:
        """A refusal's text for the caller: the model server's message, else the error."""
        return self.message or self.error or "the node refused the request"

    @property
    def code(self) -> str | None:
        """A refusal's machine-readable code: `error` when the message says the rest and
        `error` is a short token (letters, digits, `_.:-`); else None."""
        code = self.error
        if not self.message or not code or len(code) > MAX_CODE_CHARS:
            return None
        return code if all(c in _CODE_CHARS for c in code) else None


NodeEvent = Delta | LogprobDelta | ReasoningDelta | Complete | Failed
