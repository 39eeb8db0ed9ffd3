"""What a stream session is told at dispatch, and the limits it holds a stream to.

This module owns `SessionSettings` (the values resolved once per request, that
never change during the stream), the caller's trace hook type, and the
session's limits: the cap on an answer it must hold whole and the slice a long
delta is applied in. They are data: what the session does with them is
`edge.stream.session`'s.

It knows nothing of requests, HTTP or config: the caller resolves every value
before the stream starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from edge.stream.sentinel import DEFAULT_SENTINELS
from edge.stream.toolcall import ToolPolicy
from edge.stream.toolparse import DEFAULT_FORMATS

__all__ = [
    "MAX_HELD_CHARS",
    "OUTPUT_TOO_LARGE",
    "SLICE_CHARS",
    "ReasoningParser",
    "SessionSettings",
    "TraceFn",
]

TraceFn = Callable[[str, Mapping[str, Any]], None]

ReasoningParser = Literal["none", "think", "think_start"]

# What a session may keep of an answer it must hold whole (non-streaming
# answers, tool calls from text, strict JSON output, stream_buffer), in
# characters of model text: past it the stream ends with `output_too_large`.
MAX_HELD_CHARS = 16 * 1024 * 1024
OUTPUT_TOO_LARGE = "output_too_large"
# The most characters of one delta applied in one step (`feed`, `resume`).
SLICE_CHARS = 64 * 1024


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """Values resolved once at dispatch; they never change during the stream."""

    run_id: str
    strict: bool = False
    stream_buffer: bool = False
    include_reasoning: bool = True
    reasoning_explicit: bool = False
    trace: bool = False
    tools: ToolPolicy = field(default_factory=ToolPolicy)
    tool_formats: tuple[str, ...] = DEFAULT_FORMATS
    sentinels: tuple[str, ...] = DEFAULT_SENTINELS
    reasoning_parser: ReasoningParser = "none"
    # The request's response_format; checked on strict output.
    response_format: Mapping[str, Any] | None = None
    # The request's json_schema says `strict: true` (OpenAI's guarantee of the schema): its
    # check applies as under strict output, the rest of strict output does not.
    strict_format: bool = False
    # The caller keeps every output event until the end (a non-streaming answer).
    whole_output: bool = False
    # The caller's renderer keeps the answer's text until the end although it streams
    # (a Responses stream repeats it in its done events): it counts against
    # max_held_chars like an answer held whole.
    text_held: bool = False
    max_held_chars: int = MAX_HELD_CHARS
    # The caller asked for logprobs: content chunks carry their tokens'
    # (`edge.stream.logprobs` has the rule for text the filters remove).
    logprobs: bool = False
    # A longer delta is applied in slices of this many characters (`resume`).
    slice_chars: int = SLICE_CHARS

    @property
    def checks_format(self) -> bool:
        """Whether the answer must honour its response_format (`output_format_problem`):
        under strict output, or when its json_schema asks for `strict: true`."""
        return self.strict or self.strict_format

    @property
    def expose_reasoning(self) -> bool:
        """Reasoning stays hidden on strict output unless the caller asked for it."""
        return self.include_reasoning and (not self.strict or self.reasoning_explicit)
