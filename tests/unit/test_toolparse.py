"""Tests of the whole-text tool-call parse: each format, what is a candidate, cleaning."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.stream.toolparse import DEFAULT_FORMATS, FORMATS, ParsedCall, parse_tool_text


def calls_of(text: str, formats: tuple[str, ...] = FORMATS) -> list[tuple[str, Any]]:
    return [(c.name, c.arguments) for c in parse_tool_text(text, formats).calls]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
            [("f", {"a": 1})],
            id="hermes",
        ),
        pytest.param(
            '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "g"}</tool_call>',
            [("f", {"a": 1}), ("g", {})],
            id="hermes-two-missing-args",
        ),
        pytest.param(
            '<tool_call>\n{"name": "f", "arguments": {}}\n'
            '<tool_call>\n{"name": "g", "arguments": {}}',
            [("f", {}), ("g", {})],
            id="hermes-unclosed",
        ),
        pytest.param(
            '<tool_call>[{"name": "f", "arguments": {}}, '
            '{"name": "g", "arguments": {}}]</tool_call>',
            [("f", {}), ("g", {})],
            id="hermes-array",
        ),
        pytest.param(
            '[TOOL_CALLS] {"name": "f", "arguments": {"a": [1, 2]}}',
            [("f", {"a": [1, 2]})],
            id="mistral-object",
        ),
        pytest.param(
            '[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{"x": "y"}',
            [("f", {"x": "y"})],
            id="mistral-call-id",
        ),
        pytest.param(
            '<|python_tag|>{"name": "f", "parameters": {"q": "x"}};{"name": "g", "parameters": {}}',
            [("f", {"q": "x"}), ("g", {})],
            id="llama-semicolons",
        ),
        pytest.param(
            '  {"type": "function", "function": {"name": "f", "arguments": "{\\"a\\": 1}"}}  ',
            [("f", {"a": 1})],
            id="bare-openai-form",
        ),
        pytest.param(
            'Calling:\n```JSON\n[{"name": "f", "parameters": {}}]\n```',
            [("f", {})],
            id="fenced-uppercase-info",
        ),
        pytest.param(
            '```json\n{"name": "f", "arguments": {"a": 1}}',
            [("f", {"a": 1})],
            id="fenced-unclosed-call",
        ),
        pytest.param(
            '<tool_call>{"name": "f", "arguments": {"s": "caf\\u00e9 ☕"}}</tool_call>',
            [("f", {"s": "café ☕"})],
            id="unicode",
        ),
    ],
)
def test_formats(text: str, expected: list[tuple[str, Any]]) -> None:
    """Each format yields its calls in order of appearance, with decoded arguments."""
    result = parse_tool_text(text, FORMATS)
    assert result.errors == ()
    assert result.candidate_found
    assert calls_of(text) == expected


@pytest.mark.parametrize(
    ("text", "cleaned"),
    [
        ('Sure.\n<tool_call>{"name": "f"}</tool_call>', "Sure."),
        ('<tool_call>{"name": "f"}</tool_call>\n\nDone.  ', "Done.  "),
        (
            'A\n<tool_call>{"name": "f"}</tool_call>\n<tool_call>{"name": "g"}</tool_call>\nB',
            "A\nB",
        ),
        ('  lead <|python_tag|>{"name": "f", "parameters": {}}<|eom_id|> tail', "  lead\ntail"),
        ('x[TOOL_CALLS][{"name": "f", "arguments": {}}]', "x"),
    ],
)
def test_cleaned_removes_markup_and_the_whitespace_it_left(text: str, cleaned: str) -> None:
    """Markup is cut out; content next to it loses whitespace on that side; pieces join
    with a newline; whitespace away from markup is kept."""
    assert parse_tool_text(text, FORMATS).cleaned == cleaned


@pytest.mark.parametrize(
    "text",
    [
        "I will use <tool_call> tags when I need a tool.",
        "The [TOOL_CALLS] token marks calls.",
        "Llama has <|python_tag|> print(1)",
        'Inline {"name": "f", "arguments": {}} in prose.',
        '{"name": "Alice", "age": 30}',
        '{"name": "f", "arguments": 3}',
        '[{"name": "f", "arguments": {}}, 3]',
        "[]",
        '```python\n{"name": "f", "arguments": {}}\n```',
        '```json\n{"a": 1}\n```\n',
        '{"note": "<tool_call>{\\"name\\": \\"f\\"}</tool_call>"}',
        '{"name": "f", "arguments": {"a": 1}',
        '{"name": "f", "arguments": {"a": NaN}}',
        "",
    ],
)
def test_not_candidates(text: str) -> None:
    """Prose that mentions a tag, JSON that is not call-shaped, mid-line or unbalanced JSON
    and non-JSON fences are content: no candidate, and the text comes back unchanged."""
    result = parse_tool_text(text, FORMATS)
    assert not result.candidate_found
    assert result.calls == ()
    assert result.errors == ()
    assert result.cleaned == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<tool_call>{broken", "tool call 1: not valid JSON"),
        ("<tool_call>{not json}</tool_call>", "tool call 1: not valid JSON"),
        ("<tool_call>\n</tool_call>", "tool call 1: empty <tool_call> block"),
        ("Answer:\n<tool_call>", "tool call 1: empty <tool_call> block"),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            'tool call 1: the object has no "name" string',
        ),
        ("<tool_call>[1]</tool_call>", "tool call 1: expected a JSON object, got int"),
        ("<tool_call>[]</tool_call>", "tool call 1: empty call list"),
        ("[TOOL_CALLS]", "tool call 1: empty [TOOL_CALLS] block"),
        ("[TOOL_CALLS][{oops", "tool call 1: not valid JSON"),
        ('[TOOL_CALLS]f[ARGS]{"a": ', 'tool call 1: arguments of "f" are not valid JSON'),
        ('<|python_tag|>{"name": "f"} trailing', "tool call 2: not valid JSON"),
    ],
)
def test_candidates_that_fail_to_parse(text: str, message: str) -> None:
    """Markup that starts a call but does not parse is a candidate with an error."""
    result = parse_tool_text(text, FORMATS)
    assert result.candidate_found
    assert result.errors
    assert result.errors[0].startswith(message)


def test_string_arguments_that_do_not_decode_are_kept_raw() -> None:
    """Arguments given as a string that is not JSON stay raw, with an error naming the call."""
    result = parse_tool_text(
        '<tool_call>{"name": "ok"}</tool_call><tool_call>{"name": "f", "arguments": "{oops"}'
        "</tool_call>",
        FORMATS,
    )
    assert result.calls[1] == ParsedCall("f", "{oops", result.calls[1].arguments_error)
    assert result.calls[1].arguments_error is not None
    assert result.errors[0].startswith('tool call 2 ("f"): arguments are not valid JSON')


def test_empty_string_arguments_mean_no_arguments() -> None:
    """`"arguments": ""` is a call without arguments, as some models emit it."""
    assert calls_of('<tool_call>{"name": "f", "arguments": ""}</tool_call>') == [("f", {})]


def test_a_prose_mention_before_a_real_call() -> None:
    """A tag followed by prose is content; a later real call is still found."""
    result = parse_tool_text(
        'Format: <tool_call> tags.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>', FORMATS
    )
    assert calls_of('Format: <tool_call> tags.\n<tool_call>{"name": "f"}</tool_call>') == [
        ("f", {})
    ]
    assert result.cleaned == "Format: <tool_call> tags."


def test_a_balanced_non_call_block_is_skipped_whole() -> None:
    """A line-start JSON value that is not a call is content, including any line-start
    call-shaped object inside it."""
    text = '[\n{"name": "f", "arguments": {}},\n3\n]'
    assert not parse_tool_text(text, FORMATS).candidate_found


def test_an_unbalanced_brace_does_not_hide_later_calls() -> None:
    """An unbalanced line-start `{` is content and the scan goes on inside it."""
    text = '{ oops\n{"name": "f", "arguments": {}}'
    result = parse_tool_text(text, FORMATS)
    assert calls_of(text) == [("f", {})]
    assert result.cleaned == "{ oops"


def test_formats_select_what_is_parsed() -> None:
    """Only the configured formats are recognised."""
    text = '{"name": "f", "arguments": {}}\n<tool_call>{"name": "g"}</tool_call>'
    assert calls_of(text, ("hermes",)) == [("g", {})]
    assert calls_of(text, ("json",)) == [("f", {})]
    assert calls_of(text, ()) == []
    assert parse_tool_text(text, ()).cleaned == text
    with pytest.raises(ValueError, match="unknown"):
        parse_tool_text(text, ("yaml",))


EXPLAINER = (
    "To call a function, the model answers with its name and arguments:\n"
    "```json\n"
    '{"name": "search", "arguments": {"query": "weather in Paris"}}\n'
    "```\n"
    "or, bare:\n"
    '{"name": "search", "arguments": {"query": "news"}}\n'
    "The client then runs it."
)


def test_default_formats_are_the_tags() -> None:
    """By default only the tag formats models write on purpose are parsed: an answer that
    shows a call as a fenced or bare JSON example is content, unchanged."""
    assert DEFAULT_FORMATS == ("hermes", "mistral", "llama")
    assert set(DEFAULT_FORMATS) < set(FORMATS)
    result = parse_tool_text(EXPLAINER)
    assert (result.calls, result.cleaned, result.candidate_found) == ((), EXPLAINER, False)
    assert calls_of(EXPLAINER) == [
        ("search", {"query": "weather in Paris"}),
        ("search", {"query": "news"}),
    ]
    tagged = EXPLAINER + '\n<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    assert [c.name for c in parse_tool_text(tagged).calls] == ["search"]


@given(st.text(max_size=60))
def test_text_without_markup_is_content(text: str) -> None:
    """Any text is either unchanged content or has a candidate; errors imply a candidate."""
    result = parse_tool_text(text, FORMATS)
    if not result.candidate_found:
        assert result.cleaned == text
        assert result.calls == ()
        assert result.errors == ()


def test_code_blocks_hide_bare_json_but_not_tags() -> None:
    """Inside a non-JSON code block a line-start call-shaped object is content, a tag
    still starts a candidate, and after the closing fence bare JSON counts again."""
    example = '```python\n{"name": "f", "arguments": {}}\n```\n'
    assert not parse_tool_text(example, FORMATS).candidate_found
    assert calls_of('```xml\n<tool_call>{"name": "f"}</tool_call>\n```') == [("f", {})]
    assert calls_of(example + '{"name": "g", "arguments": {}}') == [("g", {})]
    not_a_call = '```json\n// note\n{"name": "f", "arguments": {}}\n```'
    assert not parse_tool_text(not_a_call, FORMATS).candidate_found


# --- hostile text: floods the parse must get through in one pass --------------------

CALL = '{"name": "f", "arguments": {}}'


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("text", "calls"),
    [
        # Each line-start "{" once started its own scan to the end: 64k lines took
        # over ten minutes (1k/2k/4k lines: 0.25/1.1/4.7 s).
        ("{\n" * 64_000, []),
        ("[\n" * 64_000, []),
        # Past the candidate budget the rest of the answer is content, a call too.
        ("{\n" * 32_000 + CALL, []),
        ('{"\n' * 32_000 + CALL, []),
        # Within it, a call after failed candidates is found.
        ("{\n" * 100 + CALL, [("f", {})]),
        ('{"\n' * 100 + CALL, [("f", {})]),
        # Tags without an end, and tags followed by prose: no search or copy of the
        # rest of the text per tag.
        ("<tool_call>" * 20_000, None),
        ("<|python_tag|> hi\n" * 20_000, []),
        ("```json\n{\n" * 20_000, []),
        ("x" + "{" * 100_000, []),
        ("<" * 100_000, []),
        (" \n" * 100_000 + CALL, [("f", {})]),
    ],
    ids=["braces", "brackets", "braces-then-call", "open-strings-then-call", "braces-call",
         "open-strings-call", "tags", "llama-prose", "fences", "brace-line", "angle-line",
         "whitespace-call"],
)  # fmt: skip
def test_floods_parse_in_linear_time(text: str, calls: list[tuple[str, Any]] | None) -> None:
    """Floods of candidate starts parse in one pass (the timeout is far above the
    time it takes, far below what a quadratic scan takes), with the same answer."""
    result = parse_tool_text(text, FORMATS)
    if calls is not None:
        assert [(c.name, c.arguments) for c in result.calls] == calls
    if calls == []:
        assert result.cleaned == text


def test_newline_inside_a_string_ends_no_block() -> None:
    """A raw newline inside a string cannot be JSON: the block around it is no
    candidate, so a call on a later line is found."""
    assert calls_of('{"note": "see\n' + CALL) == [("f", {})]
    assert calls_of('{"note": "a\\\n' + CALL) == [("f", {})]
