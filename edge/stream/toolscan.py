"""Where tool-call candidates start and where their blocks end: the shared scanners.

This module owns the start rules of each text format (which characters may
begin a tag, a bare JSON block or a fence, given the line and code-block
context) and the incremental scanners that find where a bare JSON block or a
JSON fence ends. `edge.stream.toolparse` (the whole-text parse) and
`edge.stream.tooltext` (the streaming hold-back filter) both run on these, so
the filter never releases text the parse would call markup. It does not
decode JSON, know what a call looks like, the declared tools, or any I/O; the
format rules themselves are described in `edge.stream.toolparse`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from functools import lru_cache

__all__ = [
    "DEFAULT_FORMATS",
    "FENCE",
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "LLAMA_END",
    "LLAMA_TAG",
    "MISTRAL_TAG",
    "BareScan",
    "FenceScan",
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
_IN_STRING = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'["{}\[\]]')


class Start(enum.Enum):
    """What a candidate-start character at some position begins."""

    NONE = "none"  # nothing: scan on from the next character
    PARTIAL = "partial"  # a proper prefix of a tag or fence at the end: need more text
    TAG = "tag"
    BARE = "bare"
    FENCE = "fence"


class Syntax:
    """The start rules of one format list.

    `fences`: code fences are tracked (when "json" or "fenced" is on), so that a
    line-start `{` inside a code block is not a bare candidate.
    """

    __slots__ = ("bare", "fenced", "fences", "start_re", "tags")

    def __init__(self, formats: Sequence[str]) -> None:
        unknown = set(formats) - set(DEFAULT_FORMATS)
        if unknown:
            raise ValueError(f"unknown tool-call formats: {sorted(unknown)}")
        self.tags: tuple[str, ...] = tuple(tag for f, tag in _TAGS.items() if f in formats)
        self.bare = "json" in formats
        self.fenced = "fenced" in formats
        self.fences = self.bare or self.fenced
        chars = {tag[0] for tag in self.tags}
        if self.bare:
            chars |= {"{", "["}
        if self.fences:
            chars.add("`")
        self.start_re: re.Pattern[str] | None = (
            re.compile("[" + "".join(re.escape(c) for c in sorted(chars)) + "]") if chars else None
        )

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
    may start after text it already released).
    """
    k = text.rfind("\n", 0, i)
    if k < 0 and not head_at_line_start:
        return False
    start = k + 1
    return start == i or text[start:i].isspace()


class BareScan:
    """Finds where a bare JSON block starting at `start` ends (its brackets balance).

    Incremental: `advance` may be called with more text each time. Strings are
    respected; bracket kinds are not matched (invalid JSON fails to decode later).
    """

    __slots__ = ("depth", "in_string", "pos", "start")

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start
        self.depth = 0
        self.in_string = False

    def advance(self, text: str, stop: int) -> int | None:
        """Scan `text[self.pos:stop]`; return the index just past the block, or None."""
        pos = self.pos
        while pos < stop:
            if self.in_string:
                m = _IN_STRING.search(text, pos, stop)
                if m is None:
                    pos = stop
                    break
                if m.group() == "\\":
                    if m.end() >= stop:  # the escaped character has not arrived
                        pos = m.start()
                        break
                    pos = m.end() + 1
                    continue
                self.in_string = False
                pos = m.end()
                continue
            m = _STRUCTURE.search(text, pos, stop)
            if m is None:
                pos = stop
                break
            ch = m.group()
            pos = m.end()
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.pos = pos
                    return pos
        self.pos = pos
        return None

    def content(self, text: str, end: int) -> str:
        return text[self.start : end]

    def shift(self, n: int) -> None:
        self.start -= n
        self.pos -= n


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
            pos = self.pos
            while pos < stop and text[pos].isspace():
                pos += 1
            self.pos = pos
            if pos >= stop:
                return None
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
