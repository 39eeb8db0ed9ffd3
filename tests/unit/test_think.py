"""Tests of the think splitter: whole-text semantics and split invariance."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.stream.think import ThinkSplitter, has_close_think, has_open_think, split_think

OPEN = "<think>"
CLOSE = "</think>"


def run_split(
    text: str, cuts: Sequence[int], *, start_in_think: bool = False
) -> tuple[str, str, int]:
    """Feed `text` cut at `cuts`, then flush; return content, reasoning and the largest hold."""
    s = ThinkSplitter(start_in_think=start_in_think)
    points = sorted({min(max(c, 0), len(text)) for c in cuts})
    content: list[str] = []
    reasoning: list[str] = []
    max_held = 0
    prev = 0
    for p in [*points, len(text)]:
        c, r = s.feed(text[prev:p])
        content.append(c)
        reasoning.append(r)
        max_held = max(max_held, len(s.held))
        prev = p
    c, r = s.flush()
    content.append(c)
    reasoning.append(r)
    assert s.held == ""
    return "".join(content), "".join(reasoning), max_held


CASES: list[tuple[str, bool, str, str]] = [
    # text, start_in_think, content, reasoning
    ("", False, "", ""),
    ("", True, "", ""),
    ("hello", False, "hello", ""),
    ("hello", True, "", "hello"),
    ("<think>why</think>answer", False, "answer", "why"),
    ("pre<think>why</think>post", False, "prepost", "why"),
    ("<think>\nwhy\n</think>\n\nanswer", False, "\n\nanswer", "\nwhy\n"),
    ("why</think>answer", True, "answer", "why"),
    ("<think>why</think>answer", True, "answer", "why"),
    ("\n <think>why</think>answer", True, "answer", "\n why"),
    ("x<think>why</think>answer", True, "answer", "x<think>why"),
    ("<think>a</think>b<think>c</think>d", False, "bd", "ac"),
    ("<think>a<think>b</think>c</think>d", False, "c</think>d", "a<think>b"),
    ("<thinking>not a tag</thinking>", False, "<thinking>not a tag</thinking>", ""),
    ("x < y and a </ b", False, "x < y and a </ b", ""),
    ("</think>stray", False, "</think>stray", ""),
    ("<think>unclosed", False, "", "unclosed"),
    ("<thi", False, "<thi", ""),
    ("<think>why</thi", False, "", "why</thi"),
    ("<thi", True, "", "<thi"),
    ("<", True, "", "<"),
    ("</think>", True, "", ""),
]


@pytest.mark.parametrize(("text", "start", "content", "reasoning"), CASES)
def test_table_whole_and_char_by_char(text: str, start: bool, content: str, reasoning: str) -> None:
    """The whole-text function, a whole feed and one-char feeds all give the expected split."""
    assert split_think(text, start_in_think=start) == (content, reasoning)
    assert run_split(text, [], start_in_think=start)[:2] == (content, reasoning)
    assert run_split(text, range(len(text)), start_in_think=start)[:2] == (content, reasoning)


def test_partial_open_tag_held_then_released() -> None:
    """A trailing partial open tag is held as content and released by flush."""
    s = ThinkSplitter()
    assert s.feed("see <thi") == ("see ", "")
    assert s.held == "<thi"
    assert s.flush() == ("<thi", "")


def test_tag_split_across_chunks_switches_state() -> None:
    """Tags split across feeds switch channels; in_think follows the tags."""
    s = ThinkSplitter()
    assert s.feed("a<th") == ("a", "")
    assert not s.in_think
    assert s.feed("ink>r1</th") == ("", "r1")
    assert s.in_think
    assert s.feed("ink>b") == ("b", "")
    assert not s.in_think
    assert s.flush() == ("", "")


def test_only_relevant_tag_is_held() -> None:
    """Outside a block a partial close tag is not held; inside, a partial open tag is not."""
    s = ThinkSplitter()
    assert s.feed("a </thi") == ("a </thi", "")
    s = ThinkSplitter(start_in_think=True)
    assert s.feed("r ") == ("", "r ")
    assert s.feed("<thi") == ("", "<thi")


def test_start_in_think_leading_open_tag_consumed_across_chunks() -> None:
    """With start_in_think, an explicit open tag after whitespace is consumed, any split."""
    s = ThinkSplitter(start_in_think=True)
    assert s.feed("\n") == ("", "\n")
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>why</think>ok") == ("ok", "why")


def test_unclosed_block_ends_at_flush() -> None:
    """An unclosed block's text was already emitted as reasoning; flush adds nothing."""
    s = ThinkSplitter()
    assert s.feed("<think>still thinking") == ("", "still thinking")
    assert s.in_think
    assert s.flush() == ("", "")


def test_fast_path_returns_text_unchanged() -> None:
    """With nothing held, a delta without the tag's first character passes through whole."""
    s = ThinkSplitter()
    text = "plain words"
    assert s.feed(text)[0] is text


def test_custom_tags() -> None:
    """Custom tags work like the default ones."""
    assert split_think("[R]x[/R]y", open_tag="[R]", close_tag="[/R]") == ("y", "x")


@pytest.mark.parametrize("bad", ["", " <t>"])
def test_bad_tags_rejected(bad: str) -> None:
    """Empty tags or tags starting with whitespace are refused."""
    with pytest.raises(ValueError, match="must be non-empty"):
        ThinkSplitter(open_tag=bad)
    with pytest.raises(ValueError, match="must be non-empty"):
        split_think("x", close_tag=bad)


def test_has_tags() -> None:
    """The trace helpers report the presence of each tag."""
    assert has_open_think("a<think>b")
    assert not has_open_think("<thinking>")
    assert has_close_think("a</think>")
    assert not has_close_think("<think>")


ALPHABET = sorted(set(OPEN + CLOSE) | set("ab \n"))
FRAGMENTS = [
    OPEN,
    CLOSE,
    "<",
    "</",
    "<th",
    "<think",
    "</think",
    "</thi",
    "<thinking>",
    "think>",
    ">",
    "hello",
    "a",
    " ",
    "\n",
    "\n\n",
    "x < y",
]

rich_text = st.text(alphabet=ALPHABET, max_size=80)
fragment_text = st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join)
cuts = st.lists(st.integers(min_value=0, max_value=400), max_size=30)


@given(text=rich_text | fragment_text, cut_points=cuts, start=st.booleans())
def test_split_invariance(text: str, cut_points: list[int], start: bool) -> None:
    """For any split, the concatenated outputs equal split_think; the hold stays under the cap."""
    content, reasoning, max_held = run_split(text, cut_points, start_in_think=start)
    assert (content, reasoning) == split_think(text, start_in_think=start)
    assert max_held <= max(len(OPEN), len(CLOSE)) - 1


@given(text=rich_text | fragment_text, start=st.booleans())
def test_no_tag_leaks_unless_literal(text: str, start: bool) -> None:
    """Removing tags only removes text: content and reasoning together are no longer than text."""
    content, reasoning = split_think(text, start_in_think=start)
    assert len(content) + len(reasoning) <= len(text)
    if OPEN not in text and CLOSE not in text:
        assert (content, reasoning) == (("", text) if start else (text, ""))
