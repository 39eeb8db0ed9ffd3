"""Where a run that continues an earlier one stands in its answer (`RunRequest.continuation`).

A continuation holds the text and the reasoning text the earlier run(s) of the
request produced, each its events' texts concatenated. The simulated node plays
the same answer again and skips what the continuation holds: `Cut` keeps one
running offset into each (the delta events' text, the reasoning_delta events'),
and says of each text event whether to skip it (its text lies wholly within
what the continuation holds), send it whole (the run is past the cut), or send
it from a character on (the continuation ends inside it). The cut is *passed*
once both offsets reached their ends: from there every event plays as it would
have; an event with no text (empty, complete, error, ...) before it is skipped
(a terminal before it is a mismatch: the continuation holds more than the
answer).

A continuation that is not the start of the answer (another request's, or
garbage) is a ContinuationError, never a wrong answer: text that differs, one
kind's text going on past the cut while the other's continuation still holds
text (the answer's order says it came later), or an answer that ends first.

Bounded: the continuation is at most a RunRequest (4 MiB); each character of it
is compared once (`str.startswith` at an offset, no slicing per event), so a
run costs linear time in it, however its answer is cut into events; a repeated
event is compared as one string of its copies. `cut_logprobs` cuts a delta's
tokens at the same character as its text.

Pure: no asyncio, no gRPC stream.
"""

from __future__ import annotations

from collections.abc import Sequence

from edge.contract._proto.iop.node import v1 as pb

__all__ = ["TEXT_KINDS", "ContinuationError", "Cut", "cut_logprobs"]

# The event types whose text a continuation holds: `delta` in its `text`,
# `reasoning_delta` in its `reasoning`.
TEXT_KINDS = ("delta", "reasoning_delta")
_NAMES = {"delta": "text", "reasoning_delta": "reasoning"}


class ContinuationError(ValueError):
    """The continuation is not the start of this run's answer: the run answers an error."""


class Cut:
    """A run's place in the answer a continuation started (the module says the rules)."""

    __slots__ = ("_at", "_held")

    def __init__(self, text: str, reasoning: str) -> None:
        self._held = {"delta": text, "reasoning_delta": reasoning}
        # How much of each the answer has reached so far.
        self._at = {"delta": 0, "reasoning_delta": 0}

    @classmethod
    def of(cls, request: pb.RunRequest) -> Cut | None:
        """The cut of `request`'s continuation; None when it continues nothing."""
        held = request.continuation
        return None if held is None else cls(held.text, held.reasoning)

    @property
    def passed(self) -> bool:
        """Whether the answer has reached the end of both texts the continuation holds."""
        return all(self._at[kind] == len(self._held[kind]) for kind in TEXT_KINDS)

    def take(self, kind: str, text: str) -> int | None:
        """Where a `kind` event of `text` is sent from: 0, whole; k, from its character k
        on (the continuation holds the first k); None: skipped (it holds it all).

        Raises ContinuationError when the continuation differs from the answer here.
        """
        if self.passed:
            return 0
        if not text:
            return None  # no text to skip or send before the cut
        held, at = self._held[kind], self._at[kind]
        rest = len(held) - at
        if rest >= len(text):
            if not held.startswith(text, at):
                raise self._differs(kind, at)
            self._at[kind] = at + len(text)
            return None
        if rest and not text.startswith(held[at:]):  # the continuation's end: sliced once
            raise self._differs(kind, at)
        self._at[kind] = len(held)
        if not self.passed:
            other = _NAMES["reasoning_delta" if kind == "delta" else "delta"]
            raise ContinuationError(
                f"continuation: this answer's {_NAMES[kind]} goes on past the continuation's"
                f" while its {other} holds {self._left(other)} characters more than the"
                f" answer gave before that point: it is not this answer's start"
            )
        return rest

    def take_repeated(self, kind: str, text: str, times: int) -> tuple[int, int | None]:
        """`times` copies of a `kind` event of `text`: how many are skipped whole, and where
        the next copy is sent from (`take`'s answer; None: all of them are skipped).
        The copies the continuation holds are compared as one string."""
        if self.passed:
            return 0, 0
        if not text:
            return times, None
        held, at = self._held[kind], self._at[kind]
        whole = min(times, (len(held) - at) // len(text))
        if whole:
            if not held.startswith(text * whole, at):
                raise self._differs(kind, at)
            self._at[kind] = at + whole * len(text)
        if whole == times:
            return times, None
        return whole, self.take(kind, text)

    def end(self) -> None:
        """The answer ends here (a terminal event, or the end of the script): raises
        ContinuationError unless it reached the end of what the continuation holds."""
        if not self.passed:
            kind = next(k for k in TEXT_KINDS if self._at[k] < len(self._held[k]))
            raise ContinuationError(
                f"continuation: its {_NAMES[kind]} is longer than this answer's"
                f" ({len(self._held[kind])} characters, the answer has {self._at[kind]}):"
                f" it is not this answer's start"
            )

    def _left(self, name: str) -> int:
        kind = "delta" if name == "text" else "reasoning_delta"
        return len(self._held[kind]) - self._at[kind]

    def _differs(self, kind: str, at: int) -> ContinuationError:
        return ContinuationError(
            f"continuation: its {_NAMES[kind]} differs from this answer's in the"
            f" {_NAMES[kind]} event at character {at}: it is not this answer's start"
        )


def cut_logprobs(tokens: Sequence[pb.TokenLogprob], start: int) -> list[pb.TokenLogprob]:
    """The tokens of a delta sent from its character `start` on: those that sit on a
    character from `start` on (a token sits on the last character of its text laid
    over the delta's, in order, an empty one on the next), as the edge places them.
    A token partly within the continuation is kept: its last character was not sent."""
    position = 0
    for index, token in enumerate(tokens):
        size = len(token.token)
        if (position + size - 1 if size else position) >= start:
            return list(tokens[index:])
        position += size
    return []
