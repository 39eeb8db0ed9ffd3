"""Removal of leaked special tokens (sentinels) from a text stream.

This module owns the sentinel semantics: the pure whole-text function
`strip_sentinels` and the incremental `SentinelFilter` that agrees with it for
every split of its input. It does not know where the text comes from (content
or reasoning), which model produced it, or anything about I/O or event loops.

Semantics: a single left-to-right scan. At each position the scan reaches, if
one or more sentinels start there, the longest of them is removed and the scan
resumes just after it; otherwise one character is emitted and the scan moves
on. The output is never re-scanned, so removing a sentinel may leave text that
spells one: `"<|im_<|im_end|>end|>"` becomes `"<|im_end|>"`. This is what makes
the filter a streaming transducer whose output never has to be taken back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

__all__ = ["DEFAULT_SENTINELS", "SentinelFilter", "strip_sentinels"]

DEFAULT_SENTINELS: tuple[str, ...] = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|endoftext|>",
    "</s>",
    "<|end|>",
    "<end_of_turn>",
)


def _normalize(sentinels: Sequence[str]) -> tuple[str, ...]:
    """Distinct non-empty sentinels, longest first (so alternation picks the longest)."""
    return tuple(sorted({s for s in sentinels if s}, key=lambda s: (-len(s), s)))


@lru_cache(maxsize=64)
def _full_pattern(sentinels: tuple[str, ...]) -> re.Pattern[str]:
    # Python's alternation is leftmost-first: longest-first order gives the
    # longest sentinel at each position, and sub()/finditer() scan left to
    # right without re-scanning what they replaced: exactly the scan rule.
    return re.compile("|".join(map(re.escape, sentinels)))


def strip_sentinels(text: str, sentinels: Sequence[str] = DEFAULT_SENTINELS) -> str:
    """Remove every sentinel from `text` by the single-scan rule (see module docstring)."""
    normalized = _normalize(sentinels)
    if not normalized or not text:
        return text
    return _full_pattern(normalized).sub("", text)


_Compiled = tuple[
    bool, str | None, "re.Pattern[str] | None", "re.Pattern[str] | None", "re.Pattern[str] | None"
]


@lru_cache(maxsize=64)
def _compiled(sentinels: tuple[str, ...]) -> _Compiled:
    """(passthrough, single first char, first-char class, full pattern, incremental pattern)."""
    normalized = _normalize(sentinels)
    if not normalized:
        return True, None, None, None, None
    firsts = sorted({s[0] for s in normalized})
    # Fast-path probe: a single possible first character is tested with `in`;
    # several go through one precompiled character class.
    first = firsts[0] if len(firsts) == 1 else None
    first_re = re.compile("[" + "".join(map(re.escape, firsts)) + "]") if len(firsts) > 1 else None
    prefixes = sorted(
        {s[:n] for s in normalized for n in range(1, len(s))},
        key=lambda p: (-len(p), p),
    )
    # At each reached position, first ask "is the rest of the buffer a proper
    # prefix of a sentinel?" (undecidable: hold from here), then "does a
    # sentinel start here?" (longest first: remove it).
    alternatives = []
    if prefixes:
        alternatives.append("(?P<partial>(?:" + "|".join(map(re.escape, prefixes)) + r")\Z)")
    alternatives.append("(?:" + "|".join(map(re.escape, normalized)) + ")")
    return False, first, first_re, _full_pattern(normalized), re.compile("|".join(alternatives))


class SentinelFilter:
    """Incremental `strip_sentinels`: `feed` what arrives, `flush` at end of stream.

    Holds back only the suffix where the scan cannot decide yet: a position it
    has reached whose remaining text is a proper prefix of some sentinel. What
    it holds is therefore always shorter than the longest sentinel.
    """

    __slots__ = ("_first", "_first_re", "_full", "_held", "_incremental", "_passthrough")

    def __init__(self, sentinels: Sequence[str] = DEFAULT_SENTINELS) -> None:
        self._held = ""
        # One filter per stream and two per session: what depends only on the
        # sentinel set is compiled once per set.
        (self._passthrough, self._first, self._first_re, self._full, self._incremental) = _compiled(
            tuple(sentinels)
        )

    @property
    def held(self) -> str:
        """The text held back because it may still become a sentinel."""
        return self._held

    def feed(self, text: str) -> str:
        """Take the next piece of the stream; return the text that is safe to emit now."""
        if self._passthrough:
            return text
        if self._held:
            buf = self._held + text
        else:
            if self._first is not None:
                if self._first not in text:
                    return text
            elif self._first_re is not None and self._first_re.search(text) is None:
                return text
            buf = text
        assert self._incremental is not None
        out: list[str] = []
        last = 0
        for match in self._incremental.finditer(buf):
            out.append(buf[last : match.start()])
            if match.lastgroup == "partial":
                self._held = buf[match.start() :]
                return "".join(out)
            last = match.end()
        out.append(buf[last:])
        self._held = ""
        return "".join(out)

    def flush(self) -> str:
        """End of stream: release everything held, minus any sentinel it completes."""
        held, self._held = self._held, ""
        if not held or self._full is None:
            return held
        # A held partial prefix that never completed comes out as-is; only
        # when one sentinel is a prefix of another can a complete one be inside.
        return self._full.sub("", held)
