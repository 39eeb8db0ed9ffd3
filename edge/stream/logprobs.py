"""Token log-probabilities, carried through the content filters to the chunks that show them.

This module owns the logprobs rule of a stream session:

- Positions. Every character of content the node sent (its deltas' text, in
  order) has a position. A delta's tokens are laid over its text in order,
  each covering as many characters as its text has, and a token *sits on*
  its last character. A token of no characters sits on the next one; tokens
  past the end of the delta's text sit on its last character; the tokens of
  an empty delta sit on the next delta's first character.
- A token's logprobs go out with the content chunk that shows the character
  it sits on, in order. If that character never reaches the caller (a
  leaked special token, a think tag or the reasoning inside it, tool-call
  markup, text held back and then dropped because native calls won), the
  token's logprobs are dropped with it.
- Text the session writes that no node sent (the reasoning-only
  placeholder) carries no logprobs. The text a tool-call answer releases at
  its end, once the calls written as text are cut out, is matched to the
  held text from its end (the cut text joins its pieces with newlines,
  which carry no token).

How: when a request asks for logprobs, the session's content filters are
the subclasses below. Each keeps the positions of the text it holds
(`_Positions`) and, after each call, pushes the positions of what it
released, read from its input's positions and the filter's own rules (the
sentinel scan, the think tags; the tool-text filter only delays text while
streaming). The filters' outputs are unchanged, so a session with logprobs
writes the same text as one without. Only an order-preserving fact is
needed: every filter's output is a subsequence of its input, so a token
whose character lies before the last shown position and was not shown
never will be.

It knows nothing of gRPC, HTTP or the OpenAI wire format.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from edge.stream.sentinel import SentinelFilter, sentinel_spans
from edge.stream.think import CLOSE_THINK, OPEN_THINK, ThinkSplitter
from edge.stream.tooltext import ToolTextFilter

__all__ = [
    "MAX_LOGPROB_ENTRIES",
    "MAX_TOP_LOGPROBS",
    "LogprobTrack",
    "TokenLogprob",
    "TopLogprob",
    "think_content_spans",
]

# OpenAI's bound on top_logprobs; nodes are asked for at most this many.
MAX_TOP_LOGPROBS = 20
# Log-probability entries (a token, and each of its top alternatives) a session
# may keep at once: those waiting for held text, and every one of an answer
# held whole (non-streaming, stream_buffer). Past it: output_too_large.
MAX_LOGPROB_ENTRIES = 262_144

Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a position. `token_bytes` None: the UTF-8 of `token`."""

    token: str
    logprob: float
    token_bytes: bytes | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token, its log-probability, and the most likely tokens at its position."""

    token: str
    logprob: float
    token_bytes: bytes | None = None
    top: tuple[TopLogprob, ...] = ()

    @property
    def weight(self) -> int:
        """Entries it counts against MAX_LOGPROB_ENTRIES."""
        return 1 + len(self.top)


class _Positions:
    """An ordered queue of character positions, kept as `[start, end)` spans."""

    __slots__ = ("_spans", "size")

    def __init__(self) -> None:
        self._spans: deque[list[int]] = deque()
        self.size = 0

    def push(self, start: int, end: int) -> None:
        if end <= start:
            return
        spans = self._spans
        if spans and spans[-1][1] == start:
            spans[-1][1] = end
        else:
            spans.append([start, end])
        self.size += end - start

    def push_all(self, spans: Iterable[Span]) -> None:
        for start, end in spans:
            self.push(start, end)

    def take(self, n: int) -> list[Span]:
        """The first `n` positions (fewer if there are fewer), removed from the queue."""
        out: list[Span] = []
        spans = self._spans
        while n > 0 and spans:
            first = spans[0]
            start, end = first
            if end - start <= n:
                spans.popleft()
                out.append((start, end))
                n -= end - start
                self.size -= end - start
            else:
                out.append((start, start + n))
                first[0] = start + n
                self.size -= n
                n = 0
        return out


def _select(taken: Sequence[Span], kept: Iterable[Span]) -> list[Span]:
    """The positions at offsets `kept` (sorted `[a, b)` spans) of the positions `taken`."""
    out: list[Span] = []
    i = 0
    base = 0  # the offset of taken[i]'s first position
    count = len(taken)
    for a, b in kept:
        while a < b:
            while i < count and base + taken[i][1] - taken[i][0] <= a:
                base += taken[i][1] - taken[i][0]
                i += 1
            if i == count:
                return out
            start = taken[i][0] + a - base
            n = min(b - a, taken[i][1] - start)
            out.append((start, start + n))
            a += n
    return out


def think_content_spans(
    text: str,
    *,
    inside: bool,
    lead: bool,
    open_tag: str = OPEN_THINK,
    close_tag: str = CLOSE_THINK,
) -> list[Span]:
    """The spans of `text` that are content, for a `ThinkSplitter` in this state.

    `text` is what the splitter settled in one call (its input less what it
    still holds); `inside` and `lead` are its state before the call. The same
    scan as `ThinkSplitter.feed`, giving offsets instead of text.
    """
    spans: list[Span] = []
    n = len(text)
    i = 0
    if lead:
        j = n - len(text.lstrip())
        if j == n:
            return spans
        if text.startswith(open_tag, j):
            i = j + len(open_tag)
    while i < n:
        tag = close_tag if inside else open_tag
        k = text.find(tag, i)
        if k < 0:
            if not inside:
                spans.append((i, n))
            break
        if not inside and k > i:
            spans.append((i, k))
        i = k + len(tag)
        inside = not inside
    return spans


def _align_from_end(text: str, held: str) -> list[Span]:
    """Offsets of `held` matched by the characters of `text`, matched from the end.

    A character of `text` with no match left in `held` (a joining newline)
    gets no position. Linear in `len(held)`.
    """
    matched: list[int] = []
    j = len(held) - 1
    for ch in reversed(text):
        k = held.rfind(ch, 0, j + 1)
        if k < 0:
            continue
        matched.append(k)
        j = k - 1
    matched.reverse()
    spans: list[Span] = []
    for k in matched:
        if spans and spans[-1][1] == k:
            spans[-1] = (spans[-1][0], k + 1)
        else:
            spans.append((k, k + 1))
    return spans


class _TrackedSentinel(SentinelFilter):
    """A SentinelFilter that pushes the positions of the text it releases to `out`."""

    __slots__ = ("_sentinels", "_src_end", "out")

    def __init__(self, sentinels: Sequence[str]) -> None:
        super().__init__(sentinels)
        self._sentinels = tuple(sentinels)
        self._src_end = 0  # characters fed so far: the next delta's first position
        self.out = _Positions()

    def feed(self, text: str) -> str:
        before = self.held
        shown = super().feed(text)
        self._src_end += len(text)
        self._settle(before + text, len(self.held), shown)
        return shown

    def flush(self) -> str:
        before = self.held
        shown = super().flush()
        self._settle(before, 0, shown)
        return shown

    def _settle(self, buf: str, held: int, shown: str) -> None:
        base = self._src_end - len(buf)
        settled = len(buf) - held
        if len(shown) == settled:  # no sentinel: all of it was released
            self.out.push(base, base + settled)
            return
        prev = 0
        for start, end in sentinel_spans(buf[:settled], self._sentinels):
            self.out.push(base + prev, base + start)
            prev = end
        self.out.push(base + prev, base + settled)


class _TrackedThink(ThinkSplitter):
    """A ThinkSplitter that pushes the positions of the content it releases to `out`."""

    __slots__ = ("_in", "_upstream", "out")

    def __init__(self, upstream: _Positions, *, start_in_think: bool) -> None:
        super().__init__(start_in_think=start_in_think)
        self._upstream = upstream
        self._in = _Positions()
        self.out = _Positions()

    def feed(self, text: str) -> tuple[str, str]:
        self._in.push_all(self._upstream.take(len(text)))
        before, inside, lead = self.held, self.in_think, self.leading
        content, reasoning = super().feed(text)
        buf = before + text
        settled = len(buf) - len(self.held)
        if not content:
            kept: list[Span] = []
        elif not reasoning and len(content) == settled:
            kept = [(0, settled)]
        else:
            kept = think_content_spans(buf[:settled], inside=inside, lead=lead)
        self.out.push_all(_select(self._in.take(settled), kept))
        return content, reasoning

    def flush(self) -> tuple[str, str]:
        held = len(self.held)
        content, reasoning = super().flush()
        self.out.push_all(_select(self._in.take(held), [(0, held)] if content else []))
        return content, reasoning


class _TrackedTool(ToolTextFilter):
    """A ToolTextFilter that pushes the positions of the text it releases to `out`.

    While streaming the filter only delays text, so what it releases is the
    next positions it holds.
    """

    __slots__ = ("_in", "_inner", "_upstream", "out")

    def __init__(self, upstream: _Positions, formats: Sequence[str]) -> None:
        self._inner = False
        super().__init__(formats)
        self._upstream = upstream
        self._in = _Positions()
        self.out = _Positions()

    def feed(self, text: str) -> str:
        self._in.push_all(self._upstream.take(len(text)))
        self._inner = True  # the filter calls flush() itself when it gives up
        try:
            shown = super().feed(text)
        finally:
            self._inner = False
        self.out.push_all(self._in.take(len(shown)))
        return shown

    def flush_non_candidate(self) -> str:
        self._inner = True
        try:
            shown = super().flush_non_candidate()
        finally:
            self._inner = False
        self.out.push_all(self._in.take(len(shown)))
        return shown

    def flush(self) -> str:
        shown = super().flush()
        if not self._inner:
            self.out.push_all(self._in.take(len(shown)))
        return shown

    def realign(self, text: str, held: str) -> None:
        """`text`, made from the `held` text, is released instead of it (calls cut out)."""
        taken = self._in.take(self._in.size)
        self.out.push_all(_select(taken, _align_from_end(text, held)))


class LogprobTrack:
    """One session's token positions: the tracked filters, and tokens waiting for a chunk.

    `keep_all`: the caller keeps every output event (a non-streaming answer,
    a buffered stream), so tokens handed out still count against
    MAX_LOGPROB_ENTRIES.
    """

    __slots__ = ("_final", "_keep_all", "_pending", "entries", "sentinel", "think", "tool")

    def __init__(
        self,
        sentinels: Sequence[str],
        *,
        think: bool = False,
        start_in_think: bool = False,
        tool_formats: Sequence[str] | None = None,
        keep_all: bool = False,
    ) -> None:
        self.sentinel = _TrackedSentinel(sentinels)
        final = self.sentinel.out
        self.think: _TrackedThink | None = None
        if think:
            self.think = _TrackedThink(final, start_in_think=start_in_think)
            final = self.think.out
        self.tool: _TrackedTool | None = None
        if tool_formats is not None:
            self.tool = _TrackedTool(final, tool_formats)
            final = self.tool.out
        self._final = final
        self._keep_all = keep_all
        self._pending: deque[tuple[int, TokenLogprob]] = deque()
        self.entries = 0

    def add(self, length: int, tokens: Sequence[TokenLogprob]) -> None:
        """The tokens of a delta of `length` characters, before the delta is fed."""
        base = self.sentinel._src_end
        pending = self._pending
        end = 0
        for token in tokens:
            end += len(token.token)
            anchor = base + min(max(end, 1), length) - 1 if length else base
            pending.append((anchor, token))
            self.entries += token.weight

    def take(self, n: int) -> tuple[TokenLogprob, ...]:
        """The tokens of the next `n` characters of content written (the last filter's output)."""
        spans = self._final.take(n)
        pending = self._pending
        if not spans or not pending:
            return ()
        out: list[TokenLogprob] = []
        last = spans[-1][1]
        k = 0
        while pending and pending[0][0] < last:
            anchor, token = pending.popleft()
            while spans[k][1] <= anchor:
                k += 1
            if spans[k][0] <= anchor:
                out.append(token)
                if self._keep_all:
                    continue
            self.entries -= token.weight
        return tuple(out)
