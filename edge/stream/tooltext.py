"""The streaming hold-back filter for tool-call markup in content.

This module owns one rule: text that may be (the start of) tool-call markup is
not shown until it is known not to be. It reuses the start rules and block
scanners of `edge.stream.toolscan` (as `parse_tool_text` does), so it never
releases text that `parse_tool_text` would call markup. Every character is
scanned a bounded number of times, whatever the split: the filter is linear in
what it is fed. It does not know the declared tools, how
calls are validated or emitted, or anything about I/O or event loops.

What is held, from where (a candidate start):
- a tag or a proper prefix of one at the end of the text (`<tool_call>`,
  `[TOOL_CALLS]`, `<|python_tag|>`): a prefix that diverges is released; a
  whole tag puts the filter in hold-all mode: everything from the tag to the
  end of the stream is held (the session synthesizes calls at the end).
- a `{` or `[` that is the first non-whitespace character of a line: held until
  the JSON decoder reads a whole value from it or fails; a call-shaped value
  means hold-all, any other value is released and the scan goes on after it;
  text that is not JSON from there is released and the scan goes on from the
  next character.
- a ```` ``` ```` opening a line: held until the info line and the first content
  character show whether it is a JSON fence, then until the closing fence;
  handled like a bare block. Any other fence is released and opens a code
  block, in which only tags (and the closing fence) are looked for.
- the whitespace just before a candidate start, and trailing whitespace at the
  end of what was fed: markup removal strips the whitespace next to it, so
  what the filter shows stays a prefix of `ParseResult.cleaned`. At most the
  last `max_hold` characters of such a run are held; the rest is released
  (and the shown text may then stop being a prefix of the cleaned one).

The cap: when a candidate holds more than `max_hold` characters (counted from
its start character; whitespace before it is not counted), everything held is
released as content and the filter passes all further text through unchanged.
So the filter never holds more than `2 * max_hold` characters (64 Ki each by
default: at most 512 KiB of UTF-8).
The decision is made per character position, so it does not depend on how the
text was split. After the cap, shown text may contain markup.

The budget: each candidate that turns out not to be a call (see
`edge.stream.bounds`) spends the answer's candidate budget; once it is spent,
everything held is released and the rest passes through, exactly where the
whole-text parse stops looking for calls. So hostile text costs a bounded
amount of Python per answer, and what the filter shows stays a prefix of the
parse's cleaned text.

Split invariance: the decisions depend only on the text, never on how it was
cut, so for any split the concatenated `feed` outputs plus `flush()` (or plus
`flush_non_candidate()`) equal those of feeding the text whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from edge.stream.bounds import MAX_TOOL_CANDIDATE_CHARS
from edge.stream.toolbare import FAILED, OVER, PENDING, BareScan, CandidateBudget
from edge.stream.toolparse import block_values, call_values
from edge.stream.toolscan import (
    DEFAULT_FORMATS,
    FENCE,
    FenceScan,
    LineStarts,
    Start,
    StartFinder,
    syntax_for,
)

__all__ = ["ToolTextFilter"]


def _ws_start(text: str, end: int) -> int:
    """The start of the whitespace run that ends at `end`."""
    return len(text[:end].rstrip())


class ToolTextFilter:
    """Incremental hold-back of tool-call candidates: `feed` per token, flush at the end."""

    __slots__ = (
        "_bare",
        "_budget",
        "_buf",
        "_cand",
        "_disabled",
        "_hold_all",
        "_in_code",
        "_lines",
        "_max_hold",
        "_pending",
        "_pos",
        "_released_any",
        "_starts",
        "_syntax",
        "_tail",
        "_tail_len",
        "_ws_run",
    )

    def __init__(
        self,
        formats: Sequence[str] = DEFAULT_FORMATS,
        *,
        max_hold: int = MAX_TOOL_CANDIDATE_CHARS,
        budget: CandidateBudget | None = None,
    ) -> None:
        self._syntax = syntax_for(formats)
        self._max_hold = max_hold
        self._disabled = not self._syntax.active
        self._released_any = False
        # What candidates that are not calls may cost; spent, the rest is content.
        self._budget = budget or CandidateBudget()
        self._reset()

    def _reset(self) -> None:
        # Held text is `_buf` plus, in hold-all mode, the chunks in `_tail`.
        self._buf = ""
        self._tail: list[str] = []
        self._tail_len = 0
        self._pos = 0  # the scan goes on from here in `_buf`
        self._starts = StartFinder(self._syntax)
        self._cand: int | None = None  # where in `_buf` the current candidate starts
        self._pending: FenceScan | None = None
        self._bare: BareScan | None = None  # the candidate at `_cand` is a bare JSON value
        # Line starts, asked at increasing positions: whether `_buf[0]` begins a
        # line is whether nothing was released yet (released text never ends
        # in whitespace, so a line begun before `_buf` is not blank).
        self._lines = LineStarts(0, not self._released_any)
        self._hold_all = False
        self._in_code = False  # inside a code block: only tags and the closing fence count
        # A maximal whitespace run of `_buf`, (start, end), remembered so that a
        # long run (a model stuck emitting newlines) is walked once, not per feed.
        self._ws_run: tuple[int, int] | None = None

    @property
    def holding(self) -> bool:
        """Whether any text is held back."""
        return bool(self._buf or self._tail)

    def feed(self, text: str) -> str:
        """Take the next piece of content; return the text that is safe to show now."""
        if not text:
            return ""
        if self._disabled:
            return text
        if self._hold_all:
            self._tail.append(text)
            self._tail_len += len(text)
            return self._check_hold_all()
        if (
            not self._buf
            and self._released_any
            and not text[-1].isspace()
            and self._syntax.plain_piece(text)
        ):
            self._released_any = True
            self._lines.clean = False
            return text
        self._buf += text
        return self._scan()

    def flush_non_candidate(self) -> str:
        """End of stream when native tool calls won: release only what precedes a candidate.

        Held text from a (possibly partial) candidate start on is dropped, with
        the whitespace just before it.
        """
        settled = ""
        if self._bare is not None:
            # A bare value still pending may only be waiting for its next try:
            # decide it with all the text there is, as feeding it whole would.
            self._bare.tried = 0
            settled = self._scan()
        held = self._buf
        out = held if self._cand is None else held[: _ws_start(held, self._cand)]
        self._reset()
        return settled + self._released(out)

    def flush(self) -> str:
        """End of stream with no tool calls: release everything held."""
        out = self._buf + "".join(self._tail)
        self._reset()
        return self._released(out)

    def _released(self, out: str) -> str:
        if out:
            self._released_any = True
        return out

    def _check_hold_all(self) -> str:
        assert self._cand is not None
        if len(self._buf) + self._tail_len - self._cand > self._max_hold:
            return self._give_up()
        return ""

    def _give_up(self) -> str:
        """The cap: release everything held and pass the rest of the stream through."""
        out = self.flush()
        self._disabled = True
        return out

    def _scan(self) -> str:
        buf = self._buf
        syntax = self._syntax
        if self._pending is None and self._bare is None:
            self._cand = None  # a PARTIAL start is found again from `_pos`
        while True:
            bare = self._bare
            if bare is not None:
                cand = self._cand
                assert cand is not None
                end = bare.advance(buf, len(buf), final=False)
                if end == PENDING:
                    break
                if end == OVER:
                    return self._give_up()
                self._bare = None
                self._cand = None
                if end == FAILED:
                    self._pos = cand + 1
                    if not self._budget.charge(bare.cost):
                        return self._give_up()
                elif call_values(bare.value) is not None:
                    self._cand = cand
                    self._hold_all = True
                    break
                else:
                    self._pos = end
                    if not self._budget.charge():
                        return self._give_up()
                continue
            pending = self._pending
            if pending is not None:
                assert self._cand is not None
                limit = self._cand + self._max_hold
                end_at = pending.advance(buf, min(len(buf), limit))
                if end_at is None:
                    if len(buf) > limit:
                        return self._give_up()
                    break
                if pending.is_block:
                    if block_values(pending.content(buf, end_at)) is not None:
                        self._hold_all = True
                        self._pending = None
                        break
                    self._pos = end_at
                else:
                    self._pos = pending.start + len(FENCE)
                    self._in_code = True
                self._pending = None
                self._cand = None
                if not self._budget.charge():
                    return self._give_up()
                continue
            i = self._starts.find(buf, self._pos, final=False, in_code=self._in_code)
            if i < 0:
                self._pos = len(buf)
                break
            self._budget.steps += 1
            line_start = self._lines.at(buf, i)
            kind, _ = syntax.classify(buf, i, line_start, final=False, in_code=self._in_code)
            if kind is Start.NONE:
                self._pos = i + 1
                continue
            if kind is Start.FENCE and (self._in_code or not syntax.fenced):
                self._in_code = not self._in_code
                self._pos = i + len(FENCE)
                if not self._budget.charge():
                    return self._give_up()
                continue
            self._cand = self._pos = i
            if kind is Start.TAG:
                self._hold_all = True
                break
            if kind is Start.PARTIAL:
                break
            if kind is Start.BARE:
                self._bare = BareScan(i, self._max_hold)
            else:
                self._pending = FenceScan(i)
        return self._release()

    def _ws_before(self, end: int) -> int:
        """The start of the whitespace run that ends at `end` in `_buf` (memoized).

        `_buf` only grows at its end between releases, so a remembered run
        ending at or before `end` is still a run: only the text after it is new.
        """
        buf = self._buf
        run = self._ws_run
        floor = run[1] if run is not None and run[1] <= end else 0
        start = floor + len(buf[floor:end].rstrip())  # the run, found at C speed
        if run is not None and start == floor == run[1]:
            start = run[0]
        self._ws_run = (start, end)
        return start

    def _release(self) -> str:
        buf = self._buf
        end = len(buf) if self._cand is None else self._cand
        # Whitespace is held for at most `max_hold` characters: of a longer run
        # (a model stuck emitting newlines) only the last `max_hold` wait.
        cut = max(self._ws_before(end), end - self._max_hold)
        if not cut:
            return self._check_hold_all() if self._hold_all else ""
        self._lines.shift(buf, cut)
        self._starts.shift(cut)
        if self._bare is not None:
            self._bare.shift(cut)
        self._buf = buf[cut:]
        run = self._ws_run
        self._ws_run = None if run is None else (max(run[0], cut) - cut, run[1] - cut)
        self._pos -= cut
        if self._cand is not None:
            self._cand -= cut
        if self._pending is not None:
            self._pending.shift(cut)
        self._released_any = True
        out = buf[:cut]
        if self._hold_all:
            return out + self._check_hold_all()
        return out
