"""OpenAI's finish reasons: what a node's `finish_reason` becomes for the caller.

This module owns the one table from the values nodes send (vLLM, SGLang,
llama.cpp, TGI, Ollama, and engines with their own names) to the values
OpenAI's clients know: `stop`, `length`, `tool_calls`, `content_filter`,
`function_call`. Typed SDKs have closed enums for it and frameworks branch
on it, so nothing else is ever sent. A value saying the run did not finish
(`abort`, which vLLM and SGLang send, `cancelled`, `error`) maps to no
reason at all: the session ends such a run with an error terminal instead of
a finish. Any other value maps to `stop`; the node's own value is kept on the
outcome, for the request's log line.

Pure data and one lookup: it knows nothing of the stream, HTTP or nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "FINISH_REASONS",
    "MAX_NODE_REASON_CHARS",
    "OPENAI_FINISH_REASONS",
    "UNFINISHED",
    "Finish",
    "finish_of",
]

# What the edge sends: OpenAI's values and nothing else.
OPENAI_FINISH_REASONS: Final = frozenset(
    {"stop", "length", "tool_calls", "content_filter", "function_call"}
)

# A node value, lower-cased, -> OpenAI's value; None: the run did not finish.
FINISH_REASONS: Final[Mapping[str, str | None]] = {
    # OpenAI's own (vLLM, SGLang, llama.cpp, Ollama send these).
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "content_filter": "content_filter",
    "function_call": "function_call",
    # The same ends under other engines' names (TGI, Anthropic-, Gemini-style).
    "eos": "stop",
    "eos_token": "stop",
    "stop_sequence": "stop",
    "end_turn": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "safety": "content_filter",
    "recitation": "content_filter",
    # The run did not finish: the answer is cut short, whatever arrived so far.
    "abort": None,
    "aborted": None,
    "cancelled": None,
    "canceled": None,
    "error": None,
}

UNFINISHED: Final = frozenset(k for k, v in FINISH_REASONS.items() if v is None)
# A node's value is kept (for logs and messages) up to this many characters.
MAX_NODE_REASON_CHARS: Final = 64


@dataclass(frozen=True, slots=True)
class Finish:
    """A node's finish reason, read: `reason` is what the caller gets, None if unfinished."""

    reason: str | None
    # What the node sent, as sent ("" when it sent none; cut to MAX_NODE_REASON_CHARS).
    node_reason: str

    @property
    def unfinished(self) -> bool:
        return self.reason is None


def finish_of(node_reason: str | None) -> Finish:
    """The OpenAI finish reason for a node's value (none or empty: `stop`).

    Case and surrounding whitespace do not matter; a value the table does
    not know is `stop`.
    """
    sent = (node_reason or "")[:MAX_NODE_REASON_CHARS]
    key = sent.strip().lower()
    if not key:
        return Finish("stop", sent)
    return Finish(FINISH_REASONS.get(key, "stop"), sent)
