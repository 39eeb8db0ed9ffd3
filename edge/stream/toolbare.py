"""Bare JSON tool-call candidates, and the budget of candidates that are not calls.

This module owns two rules shared by the whole-text parse (`edge.stream.toolparse`)
and the streaming filter (`edge.stream.tooltext`), so the two decide alike:
where a bare JSON value that starts a line ends (read by the C JSON decoder,
within a cap; never a Python step per bracket), and what candidates that turn
out not to be calls may cost one answer before the rest of it is content (see
`edge.stream.bounds`). It does not know where candidates start, what a call
looks like, or any I/O.
"""

from __future__ import annotations

import re
from typing import Any

from edge.stream.bounds import MAX_TOOL_CANDIDATE_WORK, TOOL_CANDIDATE_COST
from edge.stream.jsontext import JSONDecodeError, raw_decode

__all__ = ["FAILED", "OVER", "PENDING", "BareScan", "CandidateBudget"]

PENDING = -2  # BareScan.advance: the value has not ended yet
FAILED = -1  # BareScan.advance: not JSON (or too deep to decode)
OVER = -3  # BareScan.advance: still open past its cap

# A decode error this close to the end of the text may be a cut token (`tru`,
# `-Infinit`, a `\\u` escape): more text may still make it valid.
_CUT_TOKEN = 9
# `{`, whitespace, then a character no JSON object can go on with.
_NOT_AN_OBJECT = re.compile(r'\{\s*+[^\s"}]')
# Characters of the first decoding try of a candidate (then 4 times more each try).
_PROBE = 1024


class BareScan:
    """Resolves the bare JSON candidate at `start`: where its value ends, or that it is none.

    The C JSON decoder reads the candidate (so a block costs C time, never a
    Python step per bracket), within `cap` characters: a value that has not
    ended there is OVER. On text that is still growing, a cut value is PENDING
    and is decoded again only once the text has doubled, so a candidate costs
    linear time whatever the split. The answer depends only on the text: the
    same for the streaming filter and for the parse of the whole text.
    A value nested deeper than `edge.stream.jsontext.MAX_DEPTH` is FAILED:
    no call nests that deep.
    """

    __slots__ = ("cap", "cost", "end", "probe", "start", "tried", "value")

    def __init__(self, start: int, cap: int, probe: int = _PROBE) -> None:
        self.start = start
        self.cap = cap
        self.probe = probe
        self.tried = 0  # characters decoded by the last try
        self.value: Any = None
        self.end = -1  # past the value, once it ended
        self.cost = 0  # characters read when it FAILED (what the budget is charged)

    def advance(self, text: str, stop: int, *, final: bool) -> int:
        """Decode with `text[:stop]`: the end of the value, PENDING, FAILED or OVER.

        With `final`, `text[:stop]` is all there is: a cut value FAILED.
        """
        avail = stop - self.start
        full = avail > self.cap  # the whole window is there: the answer is due
        size = min(avail, self.cap)
        if not (final or full) and size < 2 * self.tried:
            return PENDING
        self.tried = size
        # A short probe first: most candidates that are not JSON fail within a
        # few characters, and a window copied whole per candidate would cost
        # more than its decoding. A probe that decides (a value, or an error
        # before its end) decides for any longer text too.
        probe = min(size, self.probe)
        while True:
            answer = self._decode(text, probe)
            if answer != PENDING:
                return answer
            if probe == size:
                break
            probe = min(size, 4 * probe)
        if full:
            return OVER
        if final:
            self.cost = size
            return FAILED
        return PENDING

    def _decode(self, text: str, size: int) -> int:
        """Decode `size` characters: the end of the value, FAILED, or PENDING when cut."""
        # The common failure, answered without the decoder's exception: an object
        # whose first member does not begin with a string (`{` then `{`, a word...).
        m = _NOT_AN_OBJECT.match(text, self.start, self.start + size)
        if m is not None:
            self.cost = m.end() - 1 - self.start
            return FAILED
        snap = text[self.start : self.start + size]
        try:
            value, end = raw_decode(snap, 0)
        except JSONDecodeError as exc:
            if exc.msg.startswith("Unterminated string") or exc.pos > size - _CUT_TOKEN:
                return PENDING
            self.cost = exc.pos
            return FAILED
        except ValueError:  # a NaN/Infinity constant, or too deep
            self.cost = self.cap
            return FAILED
        self.value = value
        self.end = self.start + end
        return self.end

    def shift(self, n: int) -> None:
        """The text lost its first `n` characters."""
        self.start -= n
        if self.end >= 0:
            self.end -= n


class CandidateBudget:
    """What the candidates of one answer that are not calls may cost (see `limits`).

    `charge` says whether the budget still holds after one more such candidate
    that read `chars` characters: once it does not, the rest is content.
    `steps` counts the positions the scan examined (its Python-level steps),
    so tests can count the work instead of timing it.
    """

    __slots__ = ("left", "steps")

    def __init__(self, work: int = MAX_TOOL_CANDIDATE_WORK) -> None:
        self.left = work
        self.steps = 0

    def charge(self, chars: int = 0) -> bool:
        self.left -= TOOL_CANDIDATE_COST + chars
        return self.left >= 0
