"""Tests of the shared tool-text scanners: each agrees with its obvious, slower
definition on any text, and does the work of one pass."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from edge.stream.bounds import TOOL_CANDIDATE_COST
from edge.stream.jsontext import raw_decode
from edge.stream.toolbare import FAILED, OVER, PENDING, BareScan, CandidateBudget
from edge.stream.toolscan import (
    FORMATS,
    LineStarts,
    NextFind,
    Start,
    at_line_start,
    syntax_for,
)

HOSTILE = st.text(alphabet='{}[]"\\ \nab:,1tn', max_size=120)


def reference(text: str, start: int, cap: int) -> int:
    """The definition: the strict decoder reads one value from `start`, in `cap`
    characters of the text: its end, FAILED when it is no value, OVER when it is
    cut by the cap."""
    window = text[start : start + cap]
    try:
        _, end = raw_decode(window, 0)
    except ValueError:
        return FAILED
    return start + end


def feed_scan(
    text: str, start: int, cap: int, cuts: list[int], probe: int = 1024
) -> tuple[int, int]:
    """Resolve the candidate at `start` as the text grows at `cuts`; (answer, tries)."""
    scan = BareScan(start, cap, probe)
    tries = 0
    for stop in [*sorted(c for c in cuts if c > start), len(text)]:
        before = scan.tried
        got = scan.advance(text, min(stop, len(text)), final=stop >= len(text))
        tries += scan.tried != before
        if got != PENDING:
            return got, tries
    raise AssertionError("a final advance always answers")


@given(
    text=HOSTILE,
    cuts=st.lists(st.integers(0, 130), max_size=20),
    cap=st.sampled_from([8, 1000]),
    probe=st.sampled_from([1, 3, 1024]),
)
def test_bare_scan_answers_as_the_decoder_whatever_the_split(
    text: str, cuts: list[int], cap: int, probe: int
) -> None:
    """For every line-start bracket the scan gives the decoder's answer, however the
    text arrived and however short its first probe; a value cut by the cap is OVER
    (never a call)."""
    for i in (i for i, ch in enumerate(text) if ch in "{[" and at_line_start(text, i, True)):
        whole, _ = feed_scan(text, i, cap, [])
        assert feed_scan(text, i, cap, cuts, probe)[0] == whole
        if whole == OVER:
            assert len(text) - i > cap
        else:
            assert whole == reference(text, i, cap)


def test_bare_scan_decodes_a_growing_value_a_logarithmic_number_of_times() -> None:
    """Fed a character at a time, a long value is decoded again only when the text
    has doubled: linear work whatever the split."""
    value = '{"name": "f", "arguments": {"text": "' + "x" * 60_000 + '"}}'
    answer, tries = feed_scan(value, 0, 1 << 20, list(range(len(value))))
    assert answer == len(value)
    assert tries <= 20


def test_bare_scan_failures_cost_what_was_read() -> None:
    """A candidate that is not JSON is charged the characters read before it failed."""
    text = '{"a": 1, x' + "y" * 1000
    scan = BareScan(0, 1 << 16)
    assert scan.advance(text, len(text), final=True) == FAILED
    assert scan.cost == 9
    over = BareScan(0, 8)
    assert over.advance('{"a": [1, 2, 3]}', 16, final=False) == OVER


def test_budget_counts_candidates_and_characters() -> None:
    budget = CandidateBudget(work=3 * TOOL_CANDIDATE_COST + 10)
    assert budget.charge()
    assert budget.charge(10)
    assert budget.charge()
    assert not budget.charge()


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


@given(
    text=st.text(alphabet="{[`<> \t\n|_TOOLCALSpythonagx]", max_size=60),
    head=st.booleans(),
    final=st.booleans(),
    in_code=st.booleans(),
)
def test_start_pattern_finds_every_start(text: str, head: bool, final: bool, in_code: bool) -> None:
    """`find` (which lets the regex engine skip floods) stops at every position
    `classify` would call a start: it may stop at more, never fewer."""
    syntax = syntax_for(FORMATS)
    for i in range(len(text)):
        line_start = at_line_start(text, i, head)
        kind, _ = syntax.classify(text, i, line_start, final=final, in_code=in_code)
        if kind is not Start.NONE:
            for pos in (0, i // 2, i):
                found = syntax.find(text, pos, final=final, in_code=in_code)
                assert 0 <= found <= i, (text, i, pos)
