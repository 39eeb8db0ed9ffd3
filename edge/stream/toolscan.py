"""Where tool-call candidates start and where their blocks end: the shared scanners.

This module owns the start rules of each text format (which characters may
begin a tag, a bare JSON block or a fence, given the line and code-block
context), the incremental scanners that find where a bare JSON value or a
JSON fence ends, and where lines start, and the budget of candidates that are
not calls. Floods of start characters are skipped by the regex engine, JSON is
read by the C decoder, and past the budget the rest of an answer is content,
so the Python work per answer is bounded whatever the text (floods of `{`,
tags, backticks, whitespace). `edge.stream.toolparse` (the whole-text parse)
and `edge.stream.tooltext` (the streaming hold-back filter) both run on these,
so the filter never releases text the parse would call markup. It does not
know what a call looks like, the declared tools, or any I/O; the format rules
themselves are described in `edge.stream.toolparse`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from edge.stream.jsontext import JSONDecodeError, raw_decode
from edge.stream.limits import MAX_TOOL_CANDIDATE_WORK, TOOL_CANDIDATE_COST

__all__ = [
    "DEFAULT_FORMATS",
    "FAILED",
    "FENCE",
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "LLAMA_END",
    "LLAMA_TAG",
    "MISTRAL_TAG",
    "OVER",
    "PENDING",
    "BareScan",
    "CandidateBudget",
    "FenceScan",
    "LineStarts",
    "NextFind",
    "Start",
    "Syntax",
    "at_line_start",
    "syntax_for",
]

DEFAULT_FORMATS: tuple[str, ...] = ("hermes", "mistral", "llama", "json", "fenced")

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
MISTRAL_TAG = "[TOOL_CALLS]"
LLAMA_TAG = "<|python_tag|>"
LLAMA_END = "<|eom_id|>"
FENCE = "```"

_TAGS: dict[str, str] = {"hermes": HERMES_OPEN, "mistral": MISTRAL_TAG, "llama": LLAMA_TAG}
_NON_SPACE = re.compile(r"\S")


class Start(enum.Enum):
    """What a candidate-start character at some position begins."""

    NONE = "none"  # nothing: scan on from the next character
    PARTIAL = "partial"  # a proper prefix of a tag or fence at the end: need more text
    TAG = "tag"
    BARE = "bare"
    FENCE = "fence"


# How much indentation the start pattern itself checks before a line-start
# character; deeper indentation is checked by `classify` (8 characters per try).
_INDENT = 8


def _start_re(tags: Sequence[str], line_chars: str) -> re.Pattern[str] | None:
    """A pattern for every position `classify` may call a whole start, and few others.

    Whole tags, and a line-start character preceded (on its line) by at most
    `_INDENT` whitespace characters, or by `_INDENT` of them. A proper prefix
    of a tag at the end of the text is found by `Syntax.find`, not here: as an
    alternative it cost every `<` or `[` of a flood some thirty failed tries.
    A flood of `{`, `<` or backticks in the middle of a line is skipped by the
    regex engine: the first lookbehind (no non-space character just before)
    rejects such a character in one step. Lookbehinds see before the search
    position, so a search may start anywhere.
    """
    alternatives = [re.escape(tag) for tag in tags]
    if line_chars:
        # The character comes first (the engine then scans for it at C speed),
        # the lookbehinds, which include it, check what precedes it on its line.
        behind = [f"(?<=^[^\\S\\n]{{{k}}}.)" for k in range(_INDENT)]
        behind.append(f"(?<=[^\\S\\n]{{{_INDENT}}}.)")
        chars = "".join(re.escape(c) for c in line_chars)
        alternatives.append(f"(?<!\\S)[{chars}](?:{'|'.join(behind)})")
    if not alternatives:
        return None
    # A leading class of every first character lets the engine skip to candidates
    # at C speed (it does not work that out from the alternation itself).
    firsts = {tag[0] for tag in tags} | set(line_chars)
    first = "".join(re.escape(c) for c in sorted(firsts))
    return re.compile(f"(?m)(?=[{first}])(?:{'|'.join(alternatives)})")


class Syntax:
    """The start rules of one format list.

    `fences`: code fences are tracked (when "json" or "fenced" is on), so that a
    line-start `{` inside a code block is not a bare candidate.
    """

    __slots__ = ("bare", "code_re", "fenced", "fences", "longest", "start_re", "tag_firsts", "tags")

    def __init__(self, formats: Sequence[str]) -> None:
        unknown = set(formats) - set(DEFAULT_FORMATS)
        if unknown:
            raise ValueError(f"unknown tool-call formats: {sorted(unknown)}")
        self.tags: tuple[str, ...] = tuple(tag for f, tag in _TAGS.items() if f in formats)
        self.bare = "json" in formats
        self.fenced = "fenced" in formats
        self.fences = self.bare or self.fenced
        chars = set()
        if self.bare:
            chars |= {"{", "["}
        if self.fences:
            chars.add("`")
        self.start_re: re.Pattern[str] | None = _start_re(self.tags, "".join(sorted(chars)))
        # Inside a code block only tags and the closing fence count: a JSON dump
        # in a code block is skipped by the engine, not one line start at a time.
        self.code_re = _start_re(self.tags, FENCE[0] if self.fences else "")
        self.tag_firsts = "".join(sorted({tag[0] for tag in self.tags}))
        self.longest = max((len(tag) for tag in self.tags), default=0)

    def find(self, text: str, pos: int, *, final: bool, in_code: bool) -> int:
        """The next position from `pos` that `classify` may call a start, or -1.

        Every position `classify` would call a start is found (others may be
        too). Without `final`, a proper prefix of a tag that ends the text is a
        (partial) start: it is looked for in the last characters only.
        """
        pattern = self.code_re if in_code else self.start_re
        m = pattern.search(text, pos) if pattern is not None else None
        found = m.start() if m is not None else -1
        if not final and self.tags:
            n = len(text)
            for j in range(max(pos, n - self.longest + 1), n if found < 0 else found):
                if text[j] in self.tag_firsts and any(
                    tag.startswith(text[j:]) for tag in self.tags
                ):
                    return j
        return found

    def classify(
        self, text: str, i: int, line_start: bool, final: bool, in_code: bool
    ) -> tuple[Start, str]:
        """Classify the candidate-start character `text[i]`; the str is the tag for TAG.

        With `final` the text is complete, so a prefix at the end is not PARTIAL.
        `in_code`: inside a code block only tags and the closing fence count.
        """
        rest = len(text) - i
        partial = False
        for tag in self.tags:
            if text.startswith(tag, i):
                return Start.TAG, tag
            if not final and rest < len(tag) and tag.startswith(text[i:]):
                partial = True
        ch = text[i]
        if ch in "{[" and self.bare and line_start and not in_code:
            # "[" may still become "[TOOL_CALLS]".
            return (Start.PARTIAL if partial else Start.BARE), ""
        if ch == "`" and self.fences and line_start:
            if text.startswith(FENCE, i):
                return Start.FENCE, ""
            if not final and rest < len(FENCE) and FENCE.startswith(text[i:]):
                return Start.PARTIAL, ""
        return (Start.PARTIAL if partial else Start.NONE), ""


@lru_cache(maxsize=32)
def _syntax(formats: tuple[str, ...]) -> Syntax:
    return Syntax(formats)


def syntax_for(formats: Sequence[str]) -> Syntax:
    """The (cached) `Syntax` of a format list; raises ValueError for unknown names."""
    return _syntax(tuple(formats))


def at_line_start(text: str, i: int, head_at_line_start: bool) -> bool:
    """Whether `text[i]` is the first non-whitespace character of its line.

    `head_at_line_start` says whether `text[0]` begins a line (the filter's buffer
    may start after text it already released). One-off use; a scan that asks
    at many increasing positions uses `LineStarts`, which is linear in total.
    """
    k = text.rfind("\n", 0, i)
    if k < 0 and not head_at_line_start:
        return False
    start = k + 1
    return start == i or text[start:i].isspace()


class LineStarts:
    """`at_line_start` for increasing positions: each character is looked at once.

    A line of `n` candidate characters would otherwise cost `n` backward
    searches of up to `n` characters each. `clean` says whether everything
    from the start of the current line up to `upto` is whitespace.
    """

    __slots__ = ("clean", "upto")

    def __init__(self, upto: int = 0, clean: bool = True) -> None:
        self.upto = upto
        self.clean = clean

    def at(self, text: str, i: int) -> bool:
        """Whether `text[i]` begins its line (`i` never below the last position asked)."""
        upto = self.upto
        if i > upto:
            k = text.rfind("\n", upto, i)
            if k >= 0:
                self.clean = k + 1 == i or text[k + 1 : i].isspace()
            elif self.clean:
                self.clean = text[upto:i].isspace()
            self.upto = i
        return self.clean

    def shift(self, text: str, n: int) -> None:
        """`text` loses its first `n` characters."""
        self.at(text, n)
        self.upto -= n


PENDING = -2  # BareScan.advance: the value has not ended yet
FAILED = -1  # BareScan.advance: not JSON (or too deep to decode)
OVER = -3  # BareScan.advance: still open past its cap

# A decode error this close to the end of the text may be a cut token (`tru`,
# `-Infinit`, a `\\u` escape): more text may still make it valid.
_CUT_TOKEN = 9


class BareScan:
    """Resolves the bare JSON candidate at `start`: where its value ends, or that it is none.

    The C JSON decoder reads the candidate (so a block costs C time, never a
    Python step per bracket), within `cap` characters: a value that has not
    ended there is OVER. On text that is still growing, a cut value is PENDING
    and is decoded again only once the text has doubled, so a candidate costs
    linear time whatever the split. The answer depends only on the text: the
    same for the streaming filter and for the parse of the whole text.
    A value nested deeper than the interpreter's recursion limit lets the
    decoder fail (FAILED): no call nests that deep.
    """

    __slots__ = ("cap", "cost", "end", "start", "tried", "value")

    def __init__(self, start: int, cap: int) -> None:
        self.start = start
        self.cap = cap
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
        snap = text[self.start : self.start + size]
        try:
            value, end = raw_decode(snap, 0)
        except JSONDecodeError as exc:
            cut = exc.msg.startswith("Unterminated string") or exc.pos > size - _CUT_TOKEN
            if not cut:
                self.cost = exc.pos
                return FAILED
            if full:
                return OVER
            if final:
                self.cost = size
                return FAILED
            return PENDING
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
    """

    __slots__ = ("left",)

    def __init__(self, work: int = MAX_TOOL_CANDIDATE_WORK) -> None:
        self.left = work

    def charge(self, chars: int = 0) -> bool:
        self.left -= TOOL_CANDIDATE_COST + chars
        return self.left >= 0


class NextFind:
    """`text.find(needle, pos)` for increasing `pos`, each character searched once.

    Many tags without their closing tag (`<tool_call>` a thousand times) would
    otherwise each search the rest of the text.
    """

    __slots__ = ("found", "frm", "needle", "text")

    def __init__(self, text: str, needle: str) -> None:
        self.text = text
        self.needle = needle
        self.frm = -1
        self.found = -1

    def find(self, pos: int) -> int:
        if self.frm < 0 or pos < self.frm or (0 <= self.found < pos):
            self.found = self.text.find(self.needle, pos)
            self.frm = pos
        return self.found


MAX_INFO = 64


class FenceScan:
    """Follows a ```` ``` ```` fence starting at `start` until it is known to hold JSON
    and closes, or is known not to be a JSON fence.

    `advance` returns the index just past the closing fence, `start + 3` with
    `is_block` false when it is not a JSON fence, or None when it needs more text.
    """

    __slots__ = ("close", "content_start", "is_block", "pos", "stage", "start")

    def __init__(self, start: int) -> None:
        self.start = start
        self.stage = 0  # 0: info line, 1: first character of content, 2: closing fence
        self.pos = start + len(FENCE)
        self.content_start = -1
        self.close = -1
        self.is_block = False

    def advance(self, text: str, stop: int) -> int | None:
        if self.stage == 0:
            # An info line longer than MAX_INFO cannot be "json": deciding that
            # after MAX_INFO characters keeps each feed's look at it bounded.
            look = min(stop, self.pos + MAX_INFO + 1)
            nl = text.find("\n", self.pos, look)
            if nl < 0 and look - self.pos > MAX_INFO:
                return self.start + len(FENCE)
            info = text[self.pos : nl if nl >= 0 else stop].strip().lower()
            if not "json".startswith(info) or (nl >= 0 and info not in ("", "json")):
                return self.start + len(FENCE)
            if nl < 0:
                return None
            self.stage, self.pos = 1, nl + 1
        if self.stage == 1:
            m = _NON_SPACE.search(text, self.pos, stop)
            if m is None:
                self.pos = stop
                return None
            pos = self.pos = m.start()
            if text[pos] not in "{[":
                return self.start + len(FENCE)
            self.stage, self.content_start = 2, pos
        close = text.find(FENCE, self.pos, stop)
        if close < 0:
            self.pos = max(self.content_start, stop - len(FENCE) + 1)
            return None
        self.pos = self.close = close
        self.is_block = True
        return close + len(FENCE)

    def content(self, text: str, end: int) -> str:
        """The fenced text (`end` is what `advance` returned, or len(text) if unclosed)."""
        return text[self.content_start : self.close if self.close >= 0 else end]

    def shift(self, n: int) -> None:
        self.start -= n
        self.pos -= n
        if self.content_start >= 0:
            self.content_start -= n
        if self.close >= 0:
            self.close -= n
