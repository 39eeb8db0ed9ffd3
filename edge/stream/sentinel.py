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

__all__ = ["DEFAULT_SENTINELS", "SentinelFilter", "sentinel_spans", "strip_sentinels"]

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


def _trie(words: Sequence[str]) -> str:
    """An alternation of non-empty `words` as a prefix tree, longer words first.

    Sentinels share their first characters (`<|`): as a flat alternation every
    `<` of a flood cost one failed try per sentinel; as a tree, one per branch.
    """
    by_first: dict[str, list[str]] = {}
    for word in words:
        by_first.setdefault(word[0], []).append(word[1:])
    branches = []
    for first in sorted(by_first):
        rests = by_first[first]
        longer = [rest for rest in rests if rest]
        head = re.escape(first)
        if not longer:
            branches.append(head)
        elif len(rests) == 1:
            branches.append(head + re.escape(longer[0]))  # one word from here: a literal
        else:
            # Greedy `?`: the longer word is tried first, as the scan rule wants.
            optional = "?" if len(longer) < len(rests) else ""
            branches.append(f"{head}(?:{_trie(longer)}){optional}")
    return "|".join(branches)


@lru_cache(maxsize=64)
def _full_pattern(sentinels: tuple[str, ...]) -> re.Pattern[str]:
    # Python's alternation is leftmost-first: the tree tries longer sentinels
    # first, so it finds the longest sentinel at each position, and
    # sub()/finditer() scan left to right without re-scanning what they
    # replaced: exactly the scan rule.
    return re.compile(_trie(sentinels))


def strip_sentinels(text: str, sentinels: Sequence[str] = DEFAULT_SENTINELS) -> str:
    """Remove every sentinel from `text` by the single-scan rule (see module docstring)."""
    normalized = _normalize(sentinels)
    if not normalized or not text:
        return text
    return _full_pattern(normalized).sub("", text)


def sentinel_spans(
    text: str, sentinels: Sequence[str] = DEFAULT_SENTINELS
) -> list[tuple[int, int]]:
    """The `(start, end)` of every sentinel `strip_sentinels` removes from `text`, in order."""
    normalized = _normalize(sentinels)
    if not normalized or not text:
        return []
    return [match.span() for match in _full_pattern(normalized).finditer(text)]


_Compiled = tuple[
    bool,
    str | None,
    "re.Pattern[str] | None",
    "re.Pattern[str] | None",
    "re.Pattern[str] | None",
    int,
]


def _nested(rest: str) -> str:
    """`abc` -> `a(?:b(?:c)?)?`: any non-empty prefix of `rest`."""
    head = re.escape(rest[0])
    return head + (f"(?:{_nested(rest[1:])})?" if len(rest) > 1 else "")


@lru_cache(maxsize=64)
def _compiled(sentinels: tuple[str, ...]) -> _Compiled:
    """(passthrough, single first char, first-char class, full pattern, partial pattern,
    longest sentinel)."""
    normalized = _normalize(sentinels)
    if not normalized:
        return True, None, None, None, None, 0
    firsts = sorted({s[0] for s in normalized})
    # Fast-path probe: a single possible first character is tested with `in`;
    # several go through one precompiled character class.
    first = firsts[0] if len(firsts) == 1 else None
    first_re = re.compile("[" + "".join(map(re.escape, firsts)) + "]") if len(firsts) > 1 else None
    # A proper prefix of a sentinel that ends the text. It is searched for in
    # the last characters only: as an alternative of the scan it cost every
    # `<` of a flood dozens of failed tries.
    proper = [s[:-1] for s in normalized if len(s) > 1]
    partial = re.compile("(?:" + "|".join(map(_nested, proper)) + r")\Z") if proper else None
    longest = max(len(s) for s in normalized)
    return False, first, first_re, _full_pattern(normalized), partial, longest


class SentinelFilter:
    """Incremental `strip_sentinels`: `feed` what arrives, `flush` at end of stream.

    Holds back only the suffix where the scan cannot decide yet: a position it
    has reached whose remaining text is a proper prefix of some sentinel. What
    it holds is therefore always shorter than the longest sentinel.
    """

    __slots__ = ("_first", "_first_re", "_full", "_held", "_longest", "_partial", "_passthrough")

    def __init__(self, sentinels: Sequence[str] = DEFAULT_SENTINELS) -> None:
        self._held = ""
        # One filter per stream and two per session: what depends only on the
        # sentinel set is compiled once per set.
        (
            self._passthrough,
            self._first,
            self._first_re,
            self._full,
            self._partial,
            self._longest,
        ) = _compiled(tuple(sentinels))

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
        assert self._full is not None
        out: list[str] = []
        last = 0
        # Positions from `tail` on may begin a proper prefix that ends the text:
        # at a position the scan reaches, that question comes first (hold).
        tail = max(0, len(buf) - self._longest + 1)
        for match in self._full.finditer(buf):
            if match.start() >= tail and self._hold_from(buf, last, tail, match.start(), out):
                return "".join(out)
            out.append(buf[last : match.start()])
            last = match.end()
        if not self._hold_from(buf, last, tail, len(buf), out):
            out.append(buf[last:])
            self._held = ""
        return "".join(out)

    def _hold_from(self, buf: str, last: int, tail: int, upto: int, out: list[str]) -> bool:
        """Hold from the first position in [max(last, tail), upto] that begins a proper
        prefix of a sentinel ending `buf`; True (and `out` given the text from `last`
        up to it) if there is one."""
        if self._partial is None:
            return False
        m = self._partial.search(buf, max(last, tail))
        if m is None or m.start() > upto:
            return False
        out.append(buf[last : m.start()])
        self._held = buf[m.start() :]
        return True

    def flush(self) -> str:
        """End of stream: release everything held, minus any sentinel it completes."""
        held, self._held = self._held, ""
        if not held or self._full is None:
            return held
        # A held partial prefix that never completed comes out as-is; only
        # when one sentinel is a prefix of another can a complete one be inside.
        return self._full.sub("", held)
