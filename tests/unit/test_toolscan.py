"""Tests of the shared tool-text scanners: each agrees with its obvious, slower
definition on any text, and does the work of one pass."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.stream.toolscan import (
    DEFAULT_FORMATS,
    FAILED,
    PENDING,
    BareTrack,
    LineStarts,
    NextFind,
    Start,
    at_line_start,
    syntax_for,
)

HOSTILE = st.text(alphabet='{}[]"\\ \nab', max_size=120)


def reference_end(text: str, start: int, stop: int, final: bool) -> int:
    """The definition: scan from `start` alone until the brackets balance; a raw
    newline inside a string fails the block."""
    depth, in_string, pos = 0, False, start
    while pos < stop:
        ch = text[pos]
        if in_string:
            if ch == "\n":
                return FAILED
            if ch == "\\":
                if pos + 1 >= stop:
                    break
                if text[pos + 1] == "\n":
                    return FAILED
                pos += 2
                continue
            if ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return pos + 1
        pos += 1
    return FAILED if final else PENDING


def line_start_brackets(text: str) -> list[int]:
    return [i for i, ch in enumerate(text) if ch in "{[" and at_line_start(text, i, True)]


@given(text=HOSTILE, stop_at=st.integers(0, 130), final=st.booleans())
def test_one_pass_track_agrees_with_a_scan_per_block(text: str, stop_at: int, final: bool) -> None:
    """For every line-start bracket, asked in order, the one-pass track gives the end
    a scan of that block alone gives (with all of the text, or a prefix of it)."""
    stop = len(text) if final else min(stop_at, len(text))
    track: BareTrack | None = None
    for i in line_start_brackets(text[:stop]):
        track = track or BareTrack(i)
        assert track.end(text, i, stop, final=final) == reference_end(text, i, stop, final)


@given(text=HOSTILE, shifts=st.lists(st.integers(1, 20), max_size=5))
def test_track_survives_dropping_released_text(text: str, shifts: list[int]) -> None:
    """Positions stay absolute when the text loses its head (as the filter releases)."""
    starts = line_start_brackets(text)
    if not starts:
        return
    track = BareTrack(starts[0])
    origin = 0
    for i in starts:
        for n in shifts:
            if origin + n <= i and track.pos >= origin + n:
                assert track.shift(text[origin:], n)
                origin += n
        got = track.end(text[origin:], i, len(text) - origin, final=True)
        assert got == reference_end(text, i, len(text), True)


def test_a_thousand_open_lines_are_one_pass() -> None:
    """Every line-start `{` of a brace flood gets its answer from one scan."""
    n = 20_000
    text = "{\n" * n
    track = BareTrack(0)
    assert all(track.end(text, 2 * k, len(text), final=True) == FAILED for k in range(n))
    assert track.pos == len(text)


@given(text=st.text(alphabet=" \n\tab{", max_size=80), data=st.data())
def test_line_starts_agree_with_at_line_start(text: str, data: st.DataObject) -> None:
    """Asked at increasing positions, LineStarts answers as at_line_start does."""
    lines = LineStarts()
    positions = sorted(data.draw(st.sets(st.integers(0, max(0, len(text) - 1)))))
    for i in positions:
        if i < len(text):
            assert lines.at(text, i) == at_line_start(text, i, True)


@given(text=st.text(alphabet="<ab>", max_size=60), data=st.data())
def test_next_find_agrees_with_find(text: str, data: st.DataObject) -> None:
    """Memoized forward searches give what str.find gives."""
    finder = NextFind(text, "<a>")
    for pos in sorted(data.draw(st.lists(st.integers(0, 61), max_size=10))):
        assert finder.find(pos) == text.find("<a>", pos)


@pytest.mark.parametrize("n", [10, 1000])
def test_kill_fails_every_open_block(n: int) -> None:
    """A raw newline inside a string fails every block open around it at once, and the
    next line starts afresh."""
    text = "{\n" * n + '"x\n{"a": 1}\n'
    track = BareTrack(0)
    assert all(track.end(text, 2 * k, len(text), final=True) == FAILED for k in range(n))
    last = text.rindex("{")
    assert track.end(text, last, len(text), final=True) == len(text) - 1


@given(
    text=st.text(alphabet="{[`<> \t\n|_TOOLCALSpythonagx]", max_size=60),
    head=st.booleans(),
    final=st.booleans(),
    in_code=st.booleans(),
)
def test_start_pattern_finds_every_start(text: str, head: bool, final: bool, in_code: bool) -> None:
    """The start pattern (which lets the regex engine skip floods) matches at every
    position `classify` would call a start: it may find more, never fewer."""
    syntax = syntax_for(DEFAULT_FORMATS)
    assert syntax.start_re is not None
    for i in range(len(text)):
        line_start = at_line_start(text, i, head)
        kind, _ = syntax.classify(text, i, line_start, final=final, in_code=in_code)
        if kind is not Start.NONE:
            assert syntax.start_re.match(text, i) is not None, (text, i)
