"""Where tool-call candidates start and where their blocks end: the shared scanners.

This module owns the start rules of each text format (which characters may
begin a tag, a bare JSON block or a fence, given the line and code-block
context) and the incremental scanners that find where a bare JSON block or a
JSON fence ends, and where lines start. Each scanner looks at a character a
bounded number of times however many candidates the text holds, so the
filter and the parse stay linear on hostile text (floods of `{`, tags,
backticks, whitespace). `edge.stream.toolparse` (the whole-text parse) and
`edge.stream.tooltext` (the streaming hold-back filter) both run on these, so
the filter never releases text the parse would call markup. It does not
decode JSON, know what a call looks like, the declared tools, or any I/O; the
format rules themselves are described in `edge.stream.toolparse`.
"""

from __future__ import annotations

import bisect
import enum
import re
from collections.abc import Sequence
from functools import lru_cache

__all__ = [
    "DEFAULT_FORMATS",
    "FAILED",
    "FENCE",
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "LLAMA_END",
    "LLAMA_TAG",
    "MISTRAL_TAG",
    "PENDING",
    "BareTrack",
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
_STRUCTURE = re.compile(r'["{}\[\]]')


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
    """A pattern for every position `classify` may call a start, and few others.

    Whole tags, a proper prefix of a tag that ends the text, and a line-start
    character preceded (on its line) by at most `_INDENT` whitespace characters,
    or by `_INDENT` of them: a flood of `{`, `<` or backticks in the middle of a
    line is skipped by the regex engine instead of one character at a time.
    Lookbehinds see before the search position, so a search may start anywhere.
    """
    alternatives = [re.escape(tag) for tag in tags]
    prefixes = {tag[:n] for tag in tags for n in range(1, len(tag))}
    if prefixes:
        ends = "|".join(re.escape(p) for p in sorted(prefixes, key=lambda p: (-len(p), p)))
        alternatives.append(f"(?:{ends})\\Z")
    if line_chars:
        # The character comes first (the engine then scans for it at C speed),
        # the lookbehinds, which include it, check what precedes it on its line.
        behind = [f"(?<=^[^\\S\\n]{{{k}}}.)" for k in range(_INDENT)]
        behind.append(f"(?<=[^\\S\\n]{{{_INDENT}}}.)")
        chars = "".join(re.escape(c) for c in line_chars)
        alternatives.append(f"[{chars}](?:{'|'.join(behind)})")
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

    __slots__ = ("bare", "fenced", "fences", "start_re", "tags")

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


PENDING = -2  # BareTrack.ends: the block has not ended yet
FAILED = -1  # BareTrack.ends: the block can never end (see BareTrack)

_IN_STRING_NL = re.compile(r'["\\\n]')


class BareTrack:
    """Where the bare JSON block of every line-start `{`/`[` ends, in one pass.

    A block ends where its brackets balance; strings are respected, bracket
    kinds are not matched (invalid JSON fails to decode later). A raw newline
    inside a string ends no block: JSON strings cannot hold one, so every
    block open at that point can never be valid JSON (FAILED). That rule keeps
    every line start outside a string, so one pass answers for all line-start
    brackets at once: a bracket pushed at depth `d` closes where the depth
    first falls back to `d`. Scanning the same text again for each candidate
    (a thousand lines of `{`) would be quadratic.

    Positions are absolute: `origin` is the absolute position of `text[0]` in
    the texts passed to `advance`, so a filter that drops released text only
    moves `origin`. The track must start at a line start, outside any string.
    """

    __slots__ = ("depth", "ends", "in_string", "kept", "lines", "origin", "pending", "pos")

    def __init__(self, start: int, origin: int = 0) -> None:
        self.origin = origin
        self._reset(start)

    def _reset(self, start: int) -> None:
        self.pos = start  # absolute: everything before it has been scanned
        self.depth = 0
        self.in_string = False
        self.pending: list[tuple[int, int]] = []  # (block start, depth before it)
        self.ends: dict[int, int] = {}  # block start -> end (past the block), PENDING or FAILED
        self.kept = 0
        self.lines = LineStarts(start - self.origin)

    def end(self, text: str, start: int, stop: int, *, final: bool) -> int:
        """The end of the block at absolute `start` (PENDING while `text[:stop]` cannot tell).

        With `final`, `text[:stop]` is all there is: a block still open fails.
        """
        if start not in self.ends and start < self.pos:
            self._reset(start)  # not a line start by this track's count: start afresh
        if start >= self.pos:
            self._advance(text, start - self.origin)
            if self.in_string:  # cannot happen from a line start; start afresh to be sure
                self._reset(start)
            self.ends[start] = PENDING
            self.pending.append((start, self.depth))
            self.depth += 1
            self.lines.at(text, start - self.origin)
            self.pos = start + 1
        if self.ends.get(start, PENDING) == PENDING:
            self._advance(text, stop)
            if final:
                self._fail_pending()
        return self.ends.get(start, FAILED)

    def shift(self, text: str, n: int) -> bool:
        """`text` loses its first `n` characters; False when the track has not
        reached that point (it cannot go on: start a new one)."""
        if self.pos < self.origin + n:
            return False
        self.lines.shift(text, n)
        self.origin += n
        # Blocks that began in released text are never asked about again: drop
        # them (in bulk, so a long stack is not copied on every release).
        pending = self.pending
        gone = bisect.bisect_left(pending, (self.origin, -1 << 62))
        if gone and 2 * gone >= len(pending):
            for start, _ in pending[:gone]:
                self.ends.pop(start, None)
            del pending[:gone]
        if len(self.ends) > 2 * self.kept + 64:
            self.ends = {k: v for k, v in self.ends.items() if k >= self.origin}
            self.kept = len(self.ends)
        return True

    def _fail_pending(self) -> None:
        for start, _ in self.pending:
            self.ends[start] = FAILED
        self.pending.clear()

    def _advance(self, text: str, stop: int) -> None:
        origin = self.origin
        pos = self.pos - origin
        ends, pending = self.ends, self.pending
        while pos < stop:
            if self.in_string:
                m = _IN_STRING_NL.search(text, pos, stop)
                if m is None:
                    pos = stop
                    break
                ch, j = m.group(), m.start()
                if ch == "\\":
                    if j + 1 >= stop:  # the escaped character has not arrived
                        pos = j
                        break
                    if text[j + 1] != "\n":
                        pos = j + 2
                        continue
                    j += 1
                    ch = "\n"
                pos = j + 1
                self.in_string = False
                if ch == "\n":
                    self._fail_pending()
                continue
            m = _STRUCTURE.search(text, pos, stop)
            if m is None:
                pos = stop
                break
            ch, j = m.group(), m.start()
            pos = j + 1
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                if self.lines.at(text, j):
                    ends[j + origin] = PENDING
                    pending.append((j + origin, self.depth))
                self.depth += 1
            else:
                self.depth -= 1
                while pending and pending[-1][1] >= self.depth:
                    ends[pending.pop()[0]] = j + 1 + origin
        self.pos = pos + origin


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
