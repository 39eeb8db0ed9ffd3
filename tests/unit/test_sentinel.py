"""Tests of the sentinel filter: whole-text semantics and split invariance."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.stream.sentinel import DEFAULT_SENTINELS, SentinelFilter, strip_sentinels

MAX_SENTINEL = max(map(len, DEFAULT_SENTINELS))


def reference_strip(text: str, sentinels: Sequence[str]) -> str:
    """The scan rule written out by hand: longest sentinel at each reached position."""
    ordered = sorted((s for s in sentinels if s), key=len, reverse=True)
    out: list[str] = []
    i = 0
    while i < len(text):
        for s in ordered:
            if text.startswith(s, i):
                i += len(s)
                break
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def run_split(
    text: str, cuts: Sequence[int], sentinels: Sequence[str] = DEFAULT_SENTINELS
) -> tuple[str, int]:
    """Feed `text` cut at `cuts`, then flush; return the output and the largest hold."""
    f = SentinelFilter(sentinels)
    points = sorted({min(max(c, 0), len(text)) for c in cuts})
    out: list[str] = []
    prev = 0
    max_held = 0
    for p in [*points, len(text)]:
        out.append(f.feed(text[prev:p]))
        max_held = max(max_held, len(f.held))
        prev = p
    out.append(f.flush())
    assert f.held == ""
    return "".join(out), max_held


def one_char_at_a_time(text: str, sentinels: Sequence[str] = DEFAULT_SENTINELS) -> str:
    return run_split(text, range(len(text)), sentinels)[0]


CASES = [
    ("", ""),
    ("hello", "hello"),
    ("<|im_end|>hello", "hello"),
    ("hel<|im_end|>lo", "hello"),
    ("hello<|im_end|>", "hello"),
    ("a</s>b<|eot_id|>c<|endoftext|>d<|end|>e<end_of_turn>", "abcde"),
    ("<|im_end|><|im_end|>", ""),
    ("x < y and a </ b", "x < y and a </ b"),
    ("<|im_", "<|im_"),
    ("<|im_end|", "<|im_end|"),
    ("</", "</"),
    ("<<|end|>", "<"),
    ("<|end<|end|>", "<|end"),
    # The scan does not re-scan its output: removal may leave a sentinel's spelling.
    ("<|im_<|im_end|>end|>", "<|im_end|>"),
    ("<s>text</s>", "<s>text"),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_table_whole_and_char_by_char(text: str, expected: str) -> None:
    """The whole-text function, whole feed, and one-char feeds all give the expected text."""
    assert strip_sentinels(text) == expected
    assert reference_strip(text, DEFAULT_SENTINELS) == expected
    assert run_split(text, [])[0] == expected
    assert one_char_at_a_time(text) == expected


def test_partial_prefix_held_then_released_by_flush() -> None:
    """A trailing partial sentinel is held, then released as-is at end of stream."""
    f = SentinelFilter()
    assert f.feed("done <|eot") == "done "
    assert f.held == "<|eot"
    assert f.flush() == "<|eot"
    assert f.held == ""


def test_partial_prefix_completed_in_next_chunk() -> None:
    """A sentinel split across chunks is removed; text after it flows at once."""
    f = SentinelFilter()
    assert f.feed("ok<|im") == "ok"
    assert f.feed("_end|>next") == "next"
    assert f.flush() == ""


def test_partial_prefix_broken_is_released_immediately() -> None:
    """A held prefix that stops matching is emitted by the feed that breaks it."""
    f = SentinelFilter()
    assert f.feed("a <|") == "a "
    assert f.feed("x") == "<|x"
    assert f.held == ""


def test_fast_path_returns_same_object() -> None:
    """With nothing held and no sentinel first character, the text comes back untouched."""
    f = SentinelFilter()
    text = "plain words"
    assert f.feed(text) is text


def test_empty_sentinel_list_is_passthrough() -> None:
    """No sentinels: every feed returns its text and nothing is ever held."""
    f = SentinelFilter(())
    assert f.feed("<|im_end|>") == "<|im_end|>"
    assert f.feed("<") == "<"
    assert f.held == ""
    assert f.flush() == ""
    assert strip_sentinels("<|im_end|>", ()) == "<|im_end|>"


PREFIX_SENTINELS = ("<a>", "<a>b", "a>", "<<")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x<a>by", "xy"),  # longest at the same position
        ("x<a>y", "xy"),
        ("x<a>", "x"),  # shorter one completes at end of stream
        ("<<ab", "ab"),  # leftmost wins: "<<" at 0, not "<a>b" at 1
        ("<<a>", ""),  # then the scan goes on: "a>" at 2
        ("<a<a>b", "<a"),
    ],
)
def test_sentinels_that_prefix_each_other(text: str, expected: str) -> None:
    """Among matches at the same position the longest is removed, leftmost first, any split."""
    assert strip_sentinels(text, PREFIX_SENTINELS) == expected
    assert reference_strip(text, PREFIX_SENTINELS) == expected
    assert one_char_at_a_time(text, PREFIX_SENTINELS) == expected
    assert run_split(text, [], PREFIX_SENTINELS)[0] == expected


def test_prefix_sentinel_held_until_decided() -> None:
    """A complete sentinel that may still grow into a longer one is held, not decided."""
    f = SentinelFilter(PREFIX_SENTINELS)
    assert f.feed("x<a>") == "x"
    assert f.held == "<a>"
    assert f.feed("c") == "c"
    assert f.flush() == ""


ALPHABET = sorted(set("".join(DEFAULT_SENTINELS)) | set("ab \n"))
FRAGMENTS = [
    *DEFAULT_SENTINELS,
    *(s[:n] for s in DEFAULT_SENTINELS for n in (1, 2, len(s) // 2, len(s) - 1)),
    "hello",
    "a",
    " ",
    "\n",
    "<",
    "</",
    "|",
    ">",
    "x < y",
]

rich_text = st.text(alphabet=ALPHABET, max_size=80)
fragment_text = st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join)
cuts = st.lists(st.integers(min_value=0, max_value=400), max_size=30)


@given(text=rich_text | fragment_text, cut_points=cuts)
def test_split_invariance_default(text: str, cut_points: list[int]) -> None:
    """For any split, feed+flush output equals strip_sentinels; the hold stays under the cap."""
    out, max_held = run_split(text, cut_points)
    assert out == strip_sentinels(text)
    assert max_held <= MAX_SENTINEL - 1


@given(text=rich_text | fragment_text)
def test_whole_text_matches_reference_scan(text: str) -> None:
    """The regex-based strip_sentinels implements the hand-written scan rule."""
    assert strip_sentinels(text) == reference_strip(text, DEFAULT_SENTINELS)


@given(
    sentinels=st.lists(st.text(alphabet="<ab>", min_size=1, max_size=4), max_size=4),
    text=st.text(alphabet="<ab>x", max_size=40),
    cut_points=cuts,
)
def test_split_invariance_arbitrary_sentinels(
    sentinels: list[str], text: str, cut_points: list[int]
) -> None:
    """Any sentinel set (overlapping, prefixes of each other): any split equals the scan."""
    expected = reference_strip(text, sentinels)
    assert strip_sentinels(text, sentinels) == expected
    out, max_held = run_split(text, cut_points, sentinels)
    assert out == expected
    assert max_held <= max((len(s) for s in sentinels), default=1) - 1
