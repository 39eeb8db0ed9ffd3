"""Where tool-call candidates start and where their blocks end: the shared scanners.

This module owns the start rules of each text format (which characters may
begin a tag, a bare JSON block or a fence, given the line and code-block
context), where starts are (`StartFinder`), and the incremental scanners that
find where a JSON fence ends and where lines start; bare JSON values and the
budget of candidates that are not calls are `edge.stream.toolbare`'s. Floods
of start characters are skipped by the regex engine or `str.find`, so the
Python work per answer is bounded whatever the text (floods of `{`, tags,
backticks, whitespace). `edge.stream.toolparse` (the whole-text parse)
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

__all__ = [
    "DEFAULT_FORMATS",
    "FENCE",
    "FORMATS",
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "LLAMA_END",
    "LLAMA_TAG",
    "MISTRAL_TAG",
    "FenceScan",
    "LineStarts",
    "NextFind",
    "Start",
    "StartFinder",
    "Syntax",
    "at_line_start",
    "syntax_for",
]

# Every format the parse knows.
FORMATS: tuple[str, ...] = ("hermes", "mistral", "llama", "json", "fenced")
# The formats parsed unless a model's config says otherwise: the tags models
# write on purpose. Bare and fenced JSON also read a call into an answer that
# merely shows one (an example of function calling), so they are opt-in.
DEFAULT_FORMATS: tuple[str, ...] = ("hermes", "mistral", "llama")

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
MISTRAL_TAG = "[TOOL_CALLS]"
LLAMA_TAG = "<|python_tag|>"
LLAMA_END = "<|eom_id|>"
FENCE = "```"

_TAGS: dict[str, str] = {"hermes": HERMES_OPEN, "mistral": MISTRAL_TAG, "llama": LLAMA_TAG}
_LONGEST = max(len(tag) for tag in _TAGS.values())
# Pieces up to this long are checked by `Syntax.plain_piece` with one search:
# longer ones by the searches of `StartFinder`, which skip floods faster.
_PIECE = 4096
_NON_SPACE = re.compile(r"\S")


class Start(enum.Enum):
    """What a candidate-start character at some position begins."""

    NONE = "none"  # nothing: scan on from the next character
    PARTIAL = "partial"  # a proper prefix of a tag or fence at the end: need more text
    TAG = "tag"
    BARE = "bare"
    FENCE = "fence"


def _line_re(tokens: Sequence[str]) -> re.Pattern[str] | None:
    """A pattern for the first non-whitespace token of a line (`{`, `[`, a fence).

    Found from the newline before it, a flood of `{`, `<` or backticks in the
    middle of a line costs C time only. Group 1 is the token.
    """
    if not tokens:
        return None
    alternatives = "|".join(re.escape(t) for t in tokens)
    # The newline first: the engine skips to newlines at C speed (an anchor `^`
    # costs a try at every position). A line start at the search position itself
    # is `_at_re`'s. Possessive: an indentation that leads to no token is not
    # backtracked.
    return re.compile(f"\\n[^\\S\\n]*+({alternatives})")


def _partial_re(tags: Sequence[str], fence: bool) -> re.Pattern[str] | None:
    """A pattern for a proper prefix of a tag (`<(?:t(?:o...)?)?\\Z`), or of a fence
    after whitespace or at the start (only a line-start fence counts), that ends
    the text."""

    def nested(rest: str) -> str:
        return re.escape(rest[0]) + (f"(?:{nested(rest[1:])})?" if len(rest) > 1 else "")

    alternatives = [nested(tag[:-1]) for tag in tags]
    if fence:
        alternatives.append(f"(?<!\\S){nested(FENCE[:-1])}")
    if not alternatives:
        return None
    return re.compile(f"(?:{'|'.join(alternatives)})\\Z")


_BLANKS = " \t\r\f\v"
_BLANK_CHUNK = 4096


def _skip_blanks(text: str, pos: int) -> int:
    """The first position from `pos` that is not an ASCII blank (a flood of spaces
    is skipped by `str.lstrip`, some twenty times faster than the regex engine;
    any other whitespace is left to the pattern)."""
    n = len(text)
    while pos < n:
        chunk = text[pos : pos + _BLANK_CHUNK]
        skipped = len(chunk) - len(chunk.lstrip(_BLANKS))
        pos += skipped
        if skipped < len(chunk):
            break
    return pos


def _at_re(tokens: Sequence[str]) -> re.Pattern[str] | None:
    """The same token after whitespace from a given position (a search that starts
    inside the indentation of a line)."""
    if not tokens:
        return None
    alternatives = "|".join(re.escape(t) for t in tokens)
    return re.compile(f"[^\\S\\n]*+({alternatives})")


class Syntax:
    """The start rules of one format list.

    `fences`: code fences are tracked (when "json" or "fenced" is on), so that a
    line-start `{` inside a code block is not a bare candidate.
    """

    __slots__ = (
        "active",
        "at_re",
        "bare",
        "code_at_re",
        "code_line_re",
        "fenced",
        "fences",
        "line_re",
        "partial_re",
        "piece_re",
        "tags",
    )

    def __init__(self, formats: Sequence[str]) -> None:
        unknown = set(formats) - set(FORMATS)
        if unknown:
            raise ValueError(f"unknown tool-call formats: {sorted(unknown)}")
        self.tags: tuple[str, ...] = tuple(tag for f, tag in _TAGS.items() if f in formats)
        self.bare = "json" in formats
        self.fenced = "fenced" in formats
        self.fences = self.bare or self.fenced
        tokens = (["{", "["] if self.bare else []) + ([FENCE] if self.fences else [])
        code_tokens = [FENCE] if self.fences else []
        self.line_re = _line_re(tokens)
        self.at_re = _at_re(tokens)
        # Inside a code block only tags and the closing fence count: a JSON dump
        # in a code block is skipped by the engine, not one line start at a time.
        self.code_line_re = _line_re(code_tokens)
        self.code_at_re = _at_re(code_tokens)
        # A proper prefix of a tag or a fence at the end of the text.
        self.partial_re = _partial_re(self.tags, self.fences)
        # Any start in a piece of text that follows released text (which never
        # ends in whitespace, so the piece does not begin a line): one search.
        alternatives = [re.escape(tag) for tag in self.tags]
        if tokens:
            alternatives.append(f"\\n[^\\S\\n]*(?:{'|'.join(re.escape(t) for t in tokens)})")
        if self.partial_re is not None:
            alternatives.append(self.partial_re.pattern)
        self.piece_re = re.compile("|".join(alternatives)) if alternatives else None
        # Whether anything is looked for at all.
        self.active = bool(self.tags or tokens)

    def plain_piece(self, text: str) -> bool:
        """Whether `text`, following text that does not end in whitespace, holds no
        start at all (nor the beginning of one at its end): a short piece is checked
        with one search."""
        if len(text) > _PIECE or self.piece_re is None:
            return self.find(text, 0, final=False, in_code=False) < 0
        return self.piece_re.search(text) is None

    def find(self, text: str, pos: int, *, final: bool, in_code: bool) -> int:
        """The next position from `pos` that `classify` may call a start, or -1.

        Every position `classify` would call a start is found (others may be
        too). Without `final`, a proper prefix of a tag or fence that ends the
        text is a (partial) start. A one-off search; a scan that asks at many
        positions uses a `StartFinder`.
        """
        return StartFinder(self).find(text, pos, final=final, in_code=in_code)

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


class StartFinder:
    """`Syntax.find` for one text that only grows at its end (and may lose its head).

    Tags are searched for with `str.find` and line tokens with an anchored
    pattern, each at C speed; what a search found (or that it found nothing
    up to the end) is remembered, so a character is searched about once per
    tag however many candidates are asked for.
    """

    __slots__ = ("_memo", "_searches", "syntax")

    def __init__(self, syntax: Syntax) -> None:
        self.syntax = syntax
        # The searches outside and inside code blocks: every tag, then a line pattern.
        tags = len(syntax.tags)
        self._searches = ((*range(tags), tags), (*range(tags), tags + 1))
        # Per search (each tag, then the line pattern outside and inside code):
        # [from, found, end]: no match in text[from:found], or, when found < 0,
        # none that begins before `end` (the text's length then, less the
        # token's length for a tag).
        self._memo: list[list[int]] = [[0, -1, 0] for _ in range(len(syntax.tags) + 2)]

    def shift(self, n: int) -> None:
        """The text lost its first `n` characters."""
        for memo in self._memo:
            memo[0] = max(0, memo[0] - n)
            if memo[1] >= 0:
                memo[1] -= n
            memo[2] = max(0, memo[2] - n)

    def _search(self, k: int, text: str, pos: int) -> int:
        memo = self._memo[k]
        frm, found, end = memo
        if frm <= pos and (pos <= found or (found < 0 and end >= len(text))):
            return found
        tags = self.syntax.tags
        if k < len(tags):
            tag = tags[k]
            start = max(pos, end - len(tag) + 1) if found < 0 and frm <= pos else pos
            found = text.find(tag, start)
            memo[:] = [pos, found, len(text)]
            return found
        pattern = self.syntax.code_line_re if k > len(tags) else self.syntax.line_re
        m = pattern.search(text, pos) if pattern is not None else None
        found = m.start(1) if m is not None else -1
        memo[:] = [pos, found, len(text)]
        return found

    def find(self, text: str, pos: int, *, final: bool, in_code: bool) -> int:
        """See `Syntax.find`."""
        syntax = self.syntax
        n = len(text)
        best = -1
        memos = self._memo
        for k in self._searches[in_code]:
            frm, found, end = memos[k]
            # The remembered answer, when it still holds (the hot path: inlined).
            if not (frm <= pos and (pos <= found or (found < 0 and end >= n))):
                found = self._search(k, text, pos)
            if found >= 0 and (best < 0 or found < best):
                best = found
        # A search from a line start or from inside the indentation of a line: the
        # line pattern cannot see the newline before the search position.
        at_re = syntax.code_at_re if in_code else syntax.at_re
        if at_re is not None and pos < len(text) and (pos == 0 or text[pos - 1].isspace()):
            m = at_re.match(text, _skip_blanks(text, pos))
            if m is not None and (best < 0 or m.start(1) < best):
                best = m.start(1)
        if not final and syntax.partial_re is not None:
            m = syntax.partial_re.search(text, max(pos, len(text) - _LONGEST + 1))
            if m is not None and (best < 0 or m.start() < best):
                return m.start()
        return best


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
