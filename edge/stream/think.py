"""Splitting `<think>...</think>` reasoning out of a model's content stream.

This module owns the think-tag semantics: the pure whole-text function
`split_think` and the incremental `ThinkSplitter` that agrees with it for every
split of its input. It does not know about sentinels, tool calls, whether the
caller sees reasoning, or anything about I/O or event loops.

Semantics: text outside a think block is content, text inside is reasoning;
the tags themselves are removed. Outside, only the open tag is recognised (a
stray close tag is content); inside, only the close tag is (a nested-looking
open tag is reasoning). After a close tag, an open tag starts a new block.
With `start_in_think` the stream begins inside a block (the template opened
it in the prompt); if the output still begins with an explicit open tag, after
optional whitespace, that tag is consumed and the whitespace is reasoning.

Newlines around tags are kept as-is: nothing is stripped after `<think>` or
`</think>`. Stripping depends on what comes next, which would need more
holding back for little gain; the caller can trim once it has the whole text.
"""

from __future__ import annotations

__all__ = ["ThinkSplitter", "has_close_think", "has_open_think", "split_think"]

OPEN_THINK = "<think>"
CLOSE_THINK = "</think>"


def has_open_think(text: str) -> bool:
    """Whether `text` contains an open think tag (for trace logging)."""
    return OPEN_THINK in text


def has_close_think(text: str) -> bool:
    """Whether `text` contains a close think tag (for trace logging)."""
    return CLOSE_THINK in text


def _check_tag(tag: str, name: str) -> None:
    if not tag or tag[0].isspace():
        raise ValueError(f"{name} must be non-empty and must not begin with whitespace")


def split_think(
    text: str,
    *,
    open_tag: str = OPEN_THINK,
    close_tag: str = CLOSE_THINK,
    start_in_think: bool = False,
) -> tuple[str, str]:
    """Split a whole text into `(content, reasoning)` (see module docstring)."""
    _check_tag(open_tag, "open_tag")
    _check_tag(close_tag, "close_tag")
    content: list[str] = []
    reasoning: list[str] = []
    inside = start_in_think
    i = 0
    if start_in_think:
        lead = len(text) - len(text.lstrip())
        if text.startswith(open_tag, lead):
            reasoning.append(text[:lead])
            i = lead + len(open_tag)
    while True:
        tag = close_tag if inside else open_tag
        sink = reasoning if inside else content
        k = text.find(tag, i)
        if k < 0:
            sink.append(text[i:])
            return "".join(content), "".join(reasoning)
        sink.append(text[i:k])
        i = k + len(tag)
        inside = not inside


def _partial_suffix(buf: str, start: int, tag: str) -> int:
    """Start of the longest suffix of `buf[start:]` that is a proper prefix of `tag`, else len."""
    n = len(buf)
    first = tag[0]
    p = buf.find(first, max(start, n - len(tag) + 1))
    while p >= 0:
        if tag.startswith(buf[p:]):
            return p
        p = buf.find(first, p + 1)
    return n


class ThinkSplitter:
    """Incremental `split_think`: `feed` returns `(content, reasoning)` safe to emit now.

    Holds back only a suffix that may still become the tag relevant in the
    current state (open tag outside, close tag inside, and at the very start of
    a `start_in_think` stream, an explicit open tag), so it holds less than the
    longest tag.
    """

    __slots__ = ("_close", "_close0", "_held", "_inside", "_lead", "_open", "_open0")

    def __init__(
        self,
        *,
        open_tag: str = OPEN_THINK,
        close_tag: str = CLOSE_THINK,
        start_in_think: bool = False,
    ) -> None:
        _check_tag(open_tag, "open_tag")
        _check_tag(close_tag, "close_tag")
        self._open = open_tag
        self._close = close_tag
        self._open0 = open_tag[0]
        self._close0 = close_tag[0]
        self._inside = start_in_think
        # True while a start_in_think stream has shown only whitespace, so an
        # explicit open tag may still come and must be consumed.
        self._lead = start_in_think
        self._held = ""

    @property
    def in_think(self) -> bool:
        """Whether the stream is currently inside a think block."""
        return self._inside

    @property
    def held(self) -> str:
        """The text held back because it may still become a tag."""
        return self._held

    @property
    def leading(self) -> bool:
        """Whether a `start_in_think` stream has shown only whitespace so far."""
        return self._lead

    def feed(self, text: str) -> tuple[str, str]:
        """Take the next piece of the stream; return `(content, reasoning)` to emit now."""
        if not self._held and not self._lead:
            if self._inside:
                if self._close0 not in text:
                    return "", text
            elif self._open0 not in text:
                return text, ""
        buf = self._held + text
        self._held = ""
        content: list[str] = []
        reasoning: list[str] = []
        i = 0
        if self._lead:
            j = len(buf) - len(buf.lstrip())
            rest = buf[j:]
            if not rest:
                return "", buf
            if rest.startswith(self._open):
                reasoning.append(buf[:j])
                i = j + len(self._open)
                self._lead = False
            elif self._open.startswith(rest):
                self._held = rest
                return "", buf[:j]
            else:
                self._lead = False
        n = len(buf)
        while True:
            inside = self._inside
            tag = self._close if inside else self._open
            sink = reasoning if inside else content
            k = buf.find(tag, i)
            if k < 0:
                cut = _partial_suffix(buf, i, tag)
                sink.append(buf[i:cut])
                self._held = buf[cut:]
                break
            sink.append(buf[i:k])
            i = k + len(tag)
            self._inside = not inside
            if i >= n:
                break
        return "".join(content), "".join(reasoning)

    def flush(self) -> tuple[str, str]:
        """End of stream: release a held partial tag as text of the current channel."""
        held, self._held = self._held, ""
        self._lead = False
        if self._inside:
            return "", held
        return held, ""
