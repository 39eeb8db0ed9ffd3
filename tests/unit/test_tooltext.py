"""Tests of the tool-text filter: streaming equals the whole-text parse, and split invariance."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.stream.toolcall import ToolPolicy, ToolSpec
from edge.stream.toolparse import FORMATS, parse_tool_text
from edge.stream.tools import synthesize_tool_calls, unstreamed_remainder
from edge.stream.tooltext import ToolTextFilter

MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|eom_id|>")

POLICY = ToolPolicy(
    tools=(
        ToolSpec(
            "get_weather",
            parameters={
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "f"]}},
                "required": ["city"],
            },
        ),
        ToolSpec("get_time", parameters={"type": "object", "properties": {"tz": {}}}),
        ToolSpec("search", parameters={"type": "object", "required": ["query"]}),
    )
)

WEATHER_PARIS = ("get_weather", {"city": "Paris"})

# (id, model output, what the caller must see as content, the calls)
CORPUS: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    (
        "qwen-single",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [WEATHER_PARIS],
    ),
    (
        "qwen-parallel-with-intro",
        "I'll check both cities.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "London"}}\n</tool_call>',
        "I'll check both cities.",
        [WEATHER_PARIS, ("get_weather", {"city": "London"})],
    ),
    (
        "hermes-content-after",
        'Sure.\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nOne moment.',
        "Sure.\nOne moment.",
        [("get_time", {})],
    ),
    (
        "hermes-string-arguments",
        '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"trio nursery\\"}"}'
        "\n</tool_call>",
        "",
        [("search", {"query": "trio nursery"})],
    ),
    (
        "mistral-array",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        "",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    (
        "mistral-two-after-prose",
        'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]',
        "Checking.",
        [WEATHER_PARIS, ("get_time", {"tz": "CET"})],
    ),
    (
        "mistral-args-form",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [WEATHER_PARIS, ("get_time", {})],
    ),
    (
        "llama-python-tag",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>',
        "",
        [WEATHER_PARIS],
    ),
    (
        "llama-two",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        "",
        [WEATHER_PARIS, ("get_weather", {"city": "Rome"})],
    ),
    (
        "bare-json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [WEATHER_PARIS],
    ),
    (
        "bare-array-pretty",
        '[\n  {"name": "get_weather", "arguments": {"city": "Paris"}},\n'
        '  {"name": "get_time", "arguments": {"tz": "CET"}}\n]',
        "",
        [WEATHER_PARIS, ("get_time", {"tz": "CET"})],
    ),
    (
        "bare-after-intro",
        'Let me look that up.\n  {"name": "search", "arguments": {"query": "weather"}}\n',
        "Let me look that up.",
        [("search", {"query": "weather"})],
    ),
    (
        "fenced-json",
        "I'll call the tool:\n```json\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        "I'll call the tool:",
        [WEATHER_PARIS],
    ),
    (
        "fenced-plain-array",
        '```\n[{"name": "get_time", "arguments": {}}]\n```\n',
        "",
        [("get_time", {})],
    ),
    (
        "code-then-bare-call",
        '```text\n{"name": "example", "arguments": {}}\n```\n{"name": "get_time", "arguments": {}}',
        '```text\n{"name": "example", "arguments": {}}\n```',
        [("get_time", {})],
    ),
    (
        "config-then-call",
        'Config:\n```json\n{"a": 1}\n```\nNow calling.\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        'Config:\n```json\n{"a": 1}\n```\nNow calling.',
        [("get_time", {})],
    ),
]

# Outputs without a call: the caller must see them exactly.
PLAIN = [
    ("prose", "The weather in Paris is sunny, 21 °C.\n"),
    ("json-in-prose", 'Here is the config:\n{"debug": true, "level": 3}\nUse it wisely.'),
    ("fenced-person", 'Example:\n```json\n{"name": "Alice", "age": 30}\n```\nThat is a person.'),
    ("mentions-tag", "I will use <tool_call> tags when I need a tool."),
    ("mentions-mistral", "Mistral emits [TOOL_CALLS] before its calls."),
    ("code", "Use `a < b` and lists like [1, 2].\n[1, 2, 3] is a list.\n"),
    ("python-fence", '```python\nprint({"name": "x"})\n```\nDone.'),
    ("unbalanced", '{"name": "get_weather", "arguments": {"city": "Par'),
    ("stray-close", "Done </tool_call> and <b>bold</b>."),
    ("example-in-code", 'Call it like:\n```python\n{"name": "f", "arguments": {}}\n```\nOk?'),
]


def token_pieces(text: str, seed: int) -> list[str]:
    """Cut `text` into pieces of 1-4 characters, like a tokenizer would."""
    rng = random.Random(seed)
    pieces: list[str] = []
    i = 0
    while i < len(text):
        n = rng.randint(1, 4)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def cut(text: str, cuts: Sequence[int]) -> list[str]:
    points = sorted({min(max(c, 0), len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def session(pieces: Sequence[str]) -> tuple[str, str, Any]:
    """What the stream session does: filter while streaming, resolve at the end.

    Returns (text shown while streaming, all text shown, the synthesis).
    """
    f = ToolTextFilter(FORMATS)
    streamed = "".join(f.feed(p) for p in pieces)
    syn = synthesize_tool_calls("".join(pieces), POLICY, "run", FORMATS)
    assert syn.error is None, syn.error
    if syn.calls:
        assert syn.cleaned.startswith(streamed)
        return streamed, streamed + unstreamed_remainder(syn.cleaned, streamed), syn
    assert not syn.candidate_found
    return streamed, streamed + f.flush(), syn


def check(pieces: Sequence[str], cleaned: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
    streamed, shown, syn = session(pieces)
    for tag in MARKUP:
        assert tag not in streamed
    assert shown == cleaned
    assert [(c.name, json.loads(c.arguments)) for c in syn.calls] == calls
    assert [c.id for c in syn.calls] == [f"call_run_{i}" for i in range(len(calls))]
    whole = parse_tool_text("".join(pieces), FORMATS)
    assert whole.cleaned == cleaned
    assert [(c.name, c.arguments) for c in whole.calls] == calls


@pytest.mark.parametrize(
    ("text", "cleaned", "calls"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS]
)
@pytest.mark.parametrize("seed", range(8))
def test_realistic_outputs_token_by_token(
    text: str, cleaned: str, calls: list[tuple[str, dict[str, Any]]], seed: int
) -> None:
    """Replayed in 1-4 character tokens, no markup is streamed, the caller sees exactly
    the whole-text parse's cleaned content, and the calls are the whole-text calls."""
    check(token_pieces(text, seed), cleaned, calls)


@pytest.mark.parametrize(
    ("text", "cleaned", "calls"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS]
)
def test_realistic_outputs_one_char_and_whole(
    text: str, cleaned: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    """The same holds one character at a time and in a single piece."""
    check(list(text), cleaned, calls)
    check([text], cleaned, calls)


@given(case=st.sampled_from(CORPUS), cuts=st.lists(st.integers(0, 200), max_size=20))
def test_realistic_outputs_any_split(
    case: tuple[str, str, str, list[tuple[str, dict[str, Any]]]], cuts: list[int]
) -> None:
    """For any split of a realistic output the caller sees the cleaned text and the calls."""
    _, text, cleaned, calls = case
    check(cut(text, cuts), cleaned, calls)


@pytest.mark.parametrize("text", [p[1] for p in PLAIN], ids=[p[0] for p in PLAIN])
@pytest.mark.parametrize("seed", range(4))
def test_outputs_without_calls_reach_the_caller_intact(text: str, seed: int) -> None:
    """Text that is not a tool call (prose that mentions tags, JSON that is not a call,
    an unbalanced object) is shown exactly, with no candidate found."""
    _, shown, syn = session(token_pieces(text, seed))
    assert shown == text
    assert syn.calls == ()


def test_prose_mentioning_a_tag_is_held_then_released() -> None:
    """A literal tag starts a hold that lasts to the end of the stream; with no call
    the flush releases it intact, and flush_non_candidate drops it."""
    text = "I will use <tool_call> tags when needed."
    f = ToolTextFilter(FORMATS)
    assert "".join(f.feed(p) for p in token_pieces(text, 1)) == "I will use"
    assert f.holding
    assert f.flush() == " <tool_call> tags when needed."
    assert not f.holding
    g = ToolTextFilter(FORMATS)
    assert g.feed(text) == "I will use"
    assert g.flush_non_candidate() == ""


def test_partial_tag_that_diverges_is_released() -> None:
    """A held tag prefix is released (with the whitespace before it) once it diverges."""
    f = ToolTextFilter(FORMATS)
    assert f.feed("a <tool") == "a"
    assert f.feed("bar> b") == " <toolbar> b"
    assert not f.holding


def test_non_call_object_is_released_when_it_closes() -> None:
    """A line-start object is held until its braces balance, then released if not a call."""
    f = ToolTextFilter(FORMATS)
    assert f.feed('{"a": "}{", ') == ""
    assert f.feed('"b": [1]') == ""
    assert f.feed("}\nmore") == '{"a": "}{", "b": [1]}\nmore'


def test_mid_line_brace_is_not_held() -> None:
    """A `{` after other text on its line is content at once (no bare-JSON candidate)."""
    f = ToolTextFilter(FORMATS)
    assert f.feed("use x = {1, 2} here") == "use x = {1, 2} here"


def test_trailing_whitespace_is_held_until_visible_text() -> None:
    """Whitespace at the end is held (markup would strip it) and released with what follows."""
    f = ToolTextFilter(FORMATS)
    assert f.feed("Hello\n") == "Hello"
    assert f.feed("World") == "\nWorld"
    assert f.feed("  ") == ""
    assert f.flush_non_candidate() == "  "


def test_flush_non_candidate_keeps_only_the_prefix() -> None:
    """After a candidate start, flush_non_candidate releases only the text before it."""
    f = ToolTextFilter(FORMATS)
    assert f.feed("Done. <tool_c") == "Done."
    assert f.flush_non_candidate() == ""
    g = ToolTextFilter(FORMATS)
    assert g.feed('Intro\n{"name": "a", "argu') == "Intro"
    assert g.flush_non_candidate() == ""


@pytest.mark.parametrize(
    "start",
    ["<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '{"name": "x", "arguments": "', "```json\n{"],
)
def test_cap_releases_and_stops_holding(start: str) -> None:
    """When a candidate holds more than max_hold characters, everything held is released
    and the rest of the stream passes through unchanged."""
    f = ToolTextFilter(FORMATS, max_hold=32)
    assert f.feed("ok\n") == "ok"
    out = f.feed(start)
    body = "x" * 40
    out += f.feed(body)
    assert out == "\n" + start + body
    assert not f.holding
    assert f.feed("<tool_call>") == "<tool_call>"
    assert f.flush() == ""


def test_cap_counts_from_the_candidate_start() -> None:
    """A candidate within max_hold is still held; whitespace before it does not count
    towards its cap, but only the last max_hold characters of it are held."""
    f = ToolTextFilter(FORMATS, max_hold=16)
    assert f.feed("a" + " " * 50 + "<tool_call>12345") == "a" + " " * 34
    assert f.holding
    assert f.feed("6") == " " * 16 + "<tool_call>123456"


def test_whitespace_flood_is_held_only_up_to_the_cap() -> None:
    """A model stuck emitting whitespace: the filter holds at most max_hold
    characters of it, whatever the split, and everything comes out in the end."""
    f = ToolTextFilter(FORMATS, max_hold=16)
    shown = "".join(f.feed(" \n") for _ in range(1000))
    assert len(shown) == 2000 - 16
    assert shown + f.flush() == " \n" * 1000


def test_formats_restrict_what_is_held() -> None:
    """Only the configured formats start candidates; unknown names are refused."""
    f = ToolTextFilter(("hermes",))
    assert f.feed('{"name": "a", "arguments": {}}') == '{"name": "a", "arguments": {}}'
    assert f.feed("[TOOL_CALLS]") == "[TOOL_CALLS]"
    assert f.feed(" <tool_call>") == ""
    none = ToolTextFilter(())
    assert none.feed("<tool_call> \n") == "<tool_call> \n"
    with pytest.raises(ValueError, match="unknown"):
        ToolTextFilter(("hermes", "xml"))


# --- split invariance --------------------------------------------------------------

FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    "<|eom_id|>",
    "[ARGS]",
    "```",
    "```json",
    "```python\n",
    "```\n",
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    "\n",
    " ",
    "  ",
    '"name": "get_time"',
    '"arguments": {}',
    '{"name": "get_time", "arguments": {}}',
    ",",
    ":",
    "<",
    "<tool",
    "[TOOL",
    "<|py",
    "`",
    "a",
    "json",
    "hi there",
]

texts = st.lists(
    st.sampled_from(FRAGMENTS) | st.text(alphabet='ab{}[]<>`"\\ \n', max_size=4), max_size=40
).map("".join)


def run(text: str, cuts: Sequence[int], max_hold: int, final: str) -> tuple[str, str]:
    """Feed `text` cut at `cuts` then flush; return (streamed, all output)."""
    f = ToolTextFilter(FORMATS, max_hold=max_hold)
    streamed = "".join(f.feed(p) for p in cut(text, cuts))
    tail = f.flush() if final == "flush" else f.flush_non_candidate()
    assert not f.holding
    return streamed, streamed + tail


@given(
    text=texts,
    cuts=st.lists(st.integers(0, 400), max_size=30),
    max_hold=st.sampled_from([4, 16, 64 * 1024]),
    final=st.sampled_from(["flush", "flush_non_candidate"]),
)
def test_split_invariance(text: str, cuts: list[int], max_hold: int, final: str) -> None:
    """For any split the total output (feeds plus either flush) equals feeding it whole,
    and with flush() it is the text itself."""
    whole = run(text, [], max_hold, final)[1]
    assert run(text, cuts, max_hold, final)[1] == whole
    assert run(text, range(len(text)), max_hold, final)[1] == whole
    if final == "flush":
        assert whole == text


@given(text=texts, cuts=st.lists(st.integers(0, 400), max_size=30))
def test_streamed_text_is_a_prefix_of_the_cleaned_text(text: str, cuts: list[int]) -> None:
    """Whatever the text, what the filter shows before the end is a prefix of the
    whole-text parse's cleaned content, and never more than the text itself."""
    streamed, _ = run(text, cuts, 64 * 1024, "flush")
    parsed = parse_tool_text(text, FORMATS)
    assert parsed.cleaned.startswith(streamed)
    assert text.startswith(streamed)


# --- hostile alphabets: floods of candidate starts -------------------------------------

FLOODS = st.tuples(
    st.sampled_from(
        ["{\n", "{", "[\n", "<", "`", "```json\n{\n", " ", "\n", '"\n', "\\", "<tool_call>",
         "<|python_tag|>", "[TOOL", '{"\n', "```\n"]
    ),
    st.integers(1, 60),
).map(lambda pair: pair[0] * pair[1])  # fmt: skip
flood_texts = st.lists(FLOODS | st.sampled_from(FRAGMENTS), max_size=8).map("".join)


@given(
    text=flood_texts,
    cuts=st.lists(st.integers(0, 1000), max_size=30),
    max_hold=st.sampled_from([16, 256, 64 * 1024]),
)
def test_split_invariance_under_floods(text: str, cuts: list[int], max_hold: int) -> None:
    """Floods of braces, tags, fences, quotes and whitespace: any split gives the
    output of feeding the text whole, and that is the text."""
    whole = run(text, [], max_hold, "flush")[1]
    assert whole == text
    assert run(text, cuts, max_hold, "flush")[1] == whole


@given(text=flood_texts, cuts=st.lists(st.integers(0, 1000), max_size=30))
def test_floods_never_stream_markup(text: str, cuts: list[int]) -> None:
    """Under floods too, what is shown before the end is a prefix of the parse's
    cleaned content."""
    streamed, _ = run(text, cuts, 64 * 1024, "flush")
    assert parse_tool_text(text, FORMATS).cleaned.startswith(streamed)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "text",
    ["x" + "{" * 100_000, "<" * 100_000, "`" * 100_000, "{\n" * 50_000, '{"\n' * 50_000],
    ids=["brace-line", "angle-line", "backtick-line", "brace-lines", "open-strings"],
)
@pytest.mark.parametrize("size", [len, lambda text: 61], ids=["whole", "chunks"])
def test_floods_filter_in_linear_time(text: str, size: Any) -> None:
    """A flood fed whole or in small pieces goes through in one pass and comes out
    unchanged (line starts are not searched for again per candidate character)."""
    step = size(text)
    assert run(text, range(0, len(text), step), 64 * 1024, "flush")[1] == text
