"""The work the tool-text scans do on hostile alphabets, counted, never timed.

Each alphabet is text a model can be prompted to write by the megabyte. The
scans' Python-level steps (positions examined, `CandidateBudget.steps`) must
not grow with the length of the text past the candidate budget: the same
count at n and 4n characters, for the whole-text parse and for the streaming
filter fed whole, and at most a few steps per piece when fed in pieces. The
rest is C work (regex, `str.find`, the JSON decoder). Whatever the budget, the
filter stays split-invariant and never shows markup the parse hides.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.stream.bounds import MAX_TEXT_TOOL_CALLS, MAX_TOOL_CANDIDATE_WORK, TOOL_CANDIDATE_COST
from edge.stream.toolbare import CandidateBudget
from edge.stream.toolparse import FORMATS, parse_tool_text
from edge.stream.tooltext import ToolTextFilter

ALPHABETS = {
    "brace-lines": "{\n",
    "brace-flood": "{",
    "bracket-lines": "[\n",
    "angle-flood": "<",
    "angle-lines": "<\n",
    "backticks": "`",
    "fence-lines": "```\n",
    "short-fences": "``\n",
    "spaces": " ",
    "newlines": "\n",
    "whitespace": " \n\t",
    "partial-tags": "<tool_cal",
    "partial-tag-lines": "<tool_cal\n",
    "open-tags": "<tool_call>{",
    "tag-lines": "<tool_call>\n",
    "llama-prose": "<|python_tag|> hi\n",
    "mistral-tags": "[TOOL_CALLS]",
    "quotes": '"',
    "open-strings": '{"\n',
    "objects": '{"a": 1}\n',
    "arrays": "[1, 2]\n",
    "strings-cut-by-newlines": '{"a": "bbbbbbbb\n',
    "deep": '{"a": [',
    "json-fences": "```json\n{}\n```\n",
    "code-fences": "```python\n{\n```\n",
    "indented-braces": "          {\n",
    "mixed-prose": "The model said [1, 2] and {x} then\n{\n  `code` <b>\n",
}
# Candidates that are not calls, at most, then a few steps that end the scan.
MAX_CHARGED = MAX_TOOL_CANDIDATE_WORK // TOOL_CANDIDATE_COST
# Steps of the parse: candidates that are not calls, or call blocks.
MAX_STEPS = max(MAX_CHARGED, MAX_TEXT_TOOL_CALLS)
SIZE = 64 * 1024


def flood(alphabet: str, size: int) -> str:
    return (alphabet * (size // len(alphabet) + 1))[:size]


def parse_steps(text: str) -> int:
    budget = CandidateBudget()
    parse_tool_text(text, FORMATS, budget=budget)
    return budget.steps


def filter_steps(text: str, piece: int) -> tuple[int, int]:
    """Steps of the filter fed `text` in pieces; and the number of pieces."""
    budget = CandidateBudget()
    f = ToolTextFilter(FORMATS, budget=budget)
    out = [f.feed(text[k : k + piece]) for k in range(0, len(text), piece)]
    assert "".join(out) + f.flush() == text
    return budget.steps, len(out)


@pytest.mark.parametrize("alphabet", list(ALPHABETS.values()), ids=list(ALPHABETS))
def test_parse_steps_do_not_grow_with_the_text(alphabet: str) -> None:
    """The parse examines as many positions at 4n characters as at n: past the
    budget (or with no candidates) the rest is left to C."""
    small, large = parse_steps(flood(alphabet, SIZE)), parse_steps(flood(alphabet, 4 * SIZE))
    assert small <= MAX_STEPS + 8
    assert large <= small + 8


@pytest.mark.parametrize("alphabet", list(ALPHABETS.values()), ids=list(ALPHABETS))
def test_filter_steps_do_not_grow_with_the_text(alphabet: str) -> None:
    """The filter fed whole does the parse's count of steps; fed in pieces, at most
    a few more per piece (each piece is looked at once)."""
    small, _ = filter_steps(flood(alphabet, SIZE), SIZE)
    large, _ = filter_steps(flood(alphabet, 4 * SIZE), 4 * SIZE)
    assert small <= MAX_CHARGED + 8
    assert large <= small + 8
    pieces_steps, pieces = filter_steps(flood(alphabet, 4 * SIZE), 4096)
    assert pieces_steps <= MAX_CHARGED + 8 + 3 * pieces


def test_a_call_after_a_few_failed_candidates_is_found() -> None:
    """Real answers: a call after some JSON-looking prose is still a call."""
    text = "Here is what I found:\n{\n[1, 2]\n```\nx\n```\n" + (
        '{"name": "f", "arguments": {"a": 1}}'
    )
    result = parse_tool_text(text, FORMATS)
    assert [(c.name, c.arguments) for c in result.calls] == [("f", {"a": 1})]


def test_past_the_budget_a_call_is_content_in_the_parse_and_the_filter() -> None:
    """Once the budget is spent the rest is content in both: the parse finds no call
    and the filter shows everything, so the two agree."""
    text = "{\n" * (MAX_CHARGED + 1) + '{"name": "f", "arguments": {}}'
    assert not parse_tool_text(text, FORMATS).calls
    f = ToolTextFilter(FORMATS)
    assert f.feed(text) + f.flush() == text


def test_too_many_calls_in_text_is_an_error_naming_the_limit() -> None:
    """Thousands of calls written as text: an error naming the limit, found after
    decoding at most that many."""
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
    result = parse_tool_text(call * 5000, FORMATS)
    assert result.errors == (f"more than {MAX_TEXT_TOOL_CALLS} tool calls in one answer",)
    assert len(result.calls) == MAX_TEXT_TOOL_CALLS


# --- split invariance and no markup shown, with a budget small enough to run out ---

HOSTILE = st.sampled_from(sorted(set(ALPHABETS.values())))
FRAGMENTS = st.sampled_from(
    ['{"name": "f", "arguments": {}}', "<tool_call>", "</tool_call>", "\n", " ", "x", "```"]
)
texts = st.lists(
    st.tuples(HOSTILE, st.integers(1, 30)).map(lambda p: p[0] * p[1]) | FRAGMENTS, max_size=10
).map("".join)


def cut(text: str, cuts: Sequence[int]) -> list[str]:
    points = sorted({0, len(text), *(c for c in cuts if 0 < c < len(text))})
    return [text[a:b] for a, b in pairwise(points)]


def run(text: str, cuts: Sequence[int], work: int, max_hold: int) -> tuple[str, str]:
    f = ToolTextFilter(FORMATS, max_hold=max_hold, budget=CandidateBudget(work))
    streamed = "".join(f.feed(p) for p in cut(text, cuts))
    return streamed, streamed + f.flush()


@given(
    text=texts,
    cuts=st.lists(st.integers(0, 2000), max_size=30),
    work=st.sampled_from([0, TOOL_CANDIDATE_COST * 3, TOOL_CANDIDATE_COST * 20]),
    max_hold=st.sampled_from([16, 64 * 1024]),
)
def test_split_invariance_with_a_small_budget(
    text: str, cuts: list[int], work: int, max_hold: int
) -> None:
    """With a budget that runs out, any split gives the output of feeding it whole
    (the budget counts the same whatever the split), and that is the text."""
    whole = run(text, [], work, max_hold)[1]
    assert whole == text
    assert run(text, cuts, work, max_hold)[1] == whole
    assert run(text, range(0, len(text), 7), work, max_hold)[1] == whole


@given(
    text=texts,
    cuts=st.lists(st.integers(0, 2000), max_size=30),
    work=st.sampled_from([0, TOOL_CANDIDATE_COST * 3, TOOL_CANDIDATE_COST * 20]),
)
def test_no_markup_shown_with_a_small_budget(text: str, cuts: list[int], work: int) -> None:
    """What the filter shows before the end is a prefix of the cleaned text of the
    parse with the same budget: the two stop looking for calls at the same place."""
    streamed, _ = run(text, cuts, work, 64 * 1024)
    parsed = parse_tool_text(text, FORMATS, budget=CandidateBudget(work))
    assert parsed.cleaned.startswith(streamed)
