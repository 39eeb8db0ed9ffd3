"""Tool-call markup in model text: the formats, and the whole-text parse.

This module owns what counts as tool-call markup in generated text and how a
whole text splits into content and candidate calls. The start rules and block
scanners live in `edge.stream.toolscan`, shared with
`edge.stream.tooltext`, whose streaming filter must never release text this
parse would call markup. It does not know the declared tools, `tool_choice`,
call ids, the stream, or any I/O.

Formats (`FORMATS` lists all; `DEFAULT_FORMATS`, the tag formats, is the default):
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the
  block ends at `</tool_call>`, at the next `<tool_call>`, or at end of text.
- "mistral": `[TOOL_CALLS]` then a JSON array or object, or `name[ARGS]{...}`
  (optionally `name[CALL_ID]id[ARGS]{...}`).
- "llama": `<|python_tag|>` then JSON objects separated by `;`, up to and
  including `<|eom_id|>` if present (else to end of text).
- "json": a bare JSON object or array of objects whose `{`/`[` is the first
  non-whitespace character of a line; it is the JSON value the decoder reads
  from there, within `MAX_TOOL_CANDIDATE_CHARS`. Text that is not JSON from
  there (a raw newline inside a string, say) is no block: the scan goes on
  from the next character.
- "fenced": a fence ```` ``` ```` / ```` ```json ```` opening a line, whose first
  non-whitespace character after the info line is `{` or `[`; the block ends at
  the next ```` ``` ```` (or at end of text when the content is a call).

What is a candidate:
- A tag (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`) is a candidate when
  what follows it (after whitespace) is JSON-like (`{` or `[`), the Mistral
  `name[ARGS]` form, or nothing (an empty or truncated block). Any other
  follower ("I will use <tool_call> tags") is prose: the tag stays content.
  A candidate that fails to parse is reported in `errors`.
- Bare and fenced JSON are candidates only when they parse and are shaped like
  calls: an object with a non-empty "name" string and an "arguments" or
  "parameters" member that is an object or a string (or the OpenAI form
  `{"type": "function", "function": {...}}`), or a non-empty array of those.
  Anything else (a config object, an unbalanced `{`) is content, and the scan
  skips a balanced non-call block whole: tags inside it are content too.
  Mid-line JSON in prose is never a candidate.
- A closed JSON fence that is not a call is content, skipped whole. Any other
  line-start fence (```` ```python ````, ```` ```json ```` not followed by `{`/`[`)
  opens a code block up to the next line-start fence; inside it only tags start
  candidates, so example JSON in code is content.

Inside a tag, a call needs only a "name" string; missing arguments mean `{}`,
and arguments given as a JSON string are decoded (kept raw, with an error, when
they do not decode). `ParseResult.cleaned` is the text with markup removed: each
piece of content next to removed markup loses its whitespace on that side, and
the remaining pieces are joined with a newline; text with no markup is
returned unchanged.

Bounds (`edge.stream.bounds`), the same as the streaming filter's:
- a bare candidate still open after `MAX_TOOL_CANDIDATE_CHARS` characters ends
  the scan: it and the rest of the text are content (the filter showed them);
- candidates that are not calls (a failed or non-call bare value, a tag in
  prose, a fence) spend the answer's `MAX_TOOL_CANDIDATE_WORK`: once it is
  spent, the rest of the text is content;
- more than `MAX_TEXT_TOOL_CALLS` calls is an error;
- the parse stops at the first block with an error (the answer fails on it).

The parse is linear in the length of the text, and its Python work is bounded
by the budget: floods of start characters are skipped by the regex engine,
JSON is read by the C decoder, closing tags are searched for once, and nothing
after a tag is copied unless it is that tag's block.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edge.stream.bounds import MAX_TEXT_TOOL_CALLS, MAX_TOOL_CANDIDATE_CHARS
from edge.stream.jsontext import loads, raw_decode
from edge.stream.toolbare import FAILED, OVER, BareScan, CandidateBudget
from edge.stream.toolscan import (
    DEFAULT_FORMATS,
    FENCE,
    FORMATS,
    HERMES_CLOSE,
    HERMES_OPEN,
    LLAMA_END,
    LLAMA_TAG,
    MISTRAL_TAG,
    FenceScan,
    LineStarts,
    NextFind,
    Start,
    StartFinder,
    syntax_for,
)

__all__ = [
    "DEFAULT_FORMATS",
    "FORMATS",
    "ParseResult",
    "ParsedCall",
    "block_values",
    "call_values",
    "loads",
    "parse_tool_text",
]

_MISTRAL_NAME = re.compile(
    r"\s*([A-Za-z0-9_.:\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_\-]*\s*)?\[ARGS\]\s*"
)
_NOT_SEPARATOR = re.compile(r"[^ \t\r\n;,]")


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call found in text. `arguments` is the decoded value, or the raw
    string (with `arguments_error` set) when a string argument did not decode."""

    name: str
    arguments: Any
    arguments_error: str | None = None


@dataclass(frozen=True, slots=True)
class ParseResult:
    """Calls in order of appearance; content with markup removed; parse problems."""

    calls: tuple[ParsedCall, ...] = ()
    cleaned: str = ""
    candidate_found: bool = False
    errors: tuple[str, ...] = ()


def _call_object(value: object) -> dict[str, Any] | None:
    """The function object of a call-shaped value (OpenAI wrapper unwrapped), or None."""
    if not isinstance(value, dict):
        return None
    inner = value.get("function")
    if isinstance(inner, dict) and value.get("type", "function") == "function":
        value = inner
    return value if isinstance(value.get("name"), str) and value["name"] else None


def _strict_call(value: object) -> bool:
    obj = _call_object(value)
    if obj is None:
        return False
    key = "arguments" if "arguments" in obj else "parameters"
    return isinstance(obj.get(key), dict | str)


def block_values(fragment: str) -> list[Any] | None:
    """The call objects of a bare/fenced block, or None when it is not shaped like calls."""
    try:
        value = loads(fragment)
    except ValueError:
        return None
    return call_values(value)


def call_values(value: object) -> list[Any] | None:
    """The call objects of a decoded block, or None when it is not shaped like calls."""
    if isinstance(value, list):
        # Past the limit on calls only whether there are too many matters.
        value = value[: MAX_TEXT_TOOL_CALLS + 1]
        return value if value and all(_strict_call(v) for v in value) else None
    return [value] if _strict_call(value) else None


def _item(value: object) -> ParsedCall | str:
    """One call from a decoded value, or a description of why it is not one."""
    obj = _call_object(value)
    if obj is None:
        if isinstance(value, dict):
            return 'the object has no "name" string'
        return f"expected a JSON object, got {type(value).__name__}"
    name: str = obj["name"]
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None or (isinstance(args, str) and not args.strip()):
        return ParsedCall(name, {})
    if isinstance(args, str):
        try:
            return ParsedCall(name, loads(args))
        except ValueError as exc:
            return ParsedCall(name, args, f"arguments are not valid JSON: {exc}")
    return ParsedCall(name, args)


def _items(values: Sequence[object]) -> list[ParsedCall | str]:
    out: list[ParsedCall | str] = []
    for value in values:
        if not isinstance(value, list):
            out.append(_item(value))
        elif value:
            out.extend(_item(v) for v in value[: MAX_TEXT_TOOL_CALLS + 1])
        else:
            out.append("empty call list")
        if len(out) > MAX_TEXT_TOOL_CALLS:
            break  # the parse reports the limit
    return out


def _decode_sequence(payload: str) -> list[ParsedCall | str]:
    """Calls from JSON values separated by whitespace, `;` or `,`."""
    values: list[object] = []
    pos = 0
    while True:
        m = _NOT_SEPARATOR.search(payload, pos)
        if m is None:
            return _items(values)
        pos = m.start()
        try:
            value, pos = raw_decode(payload, pos)
        except ValueError as exc:
            return [*_items(values), f"not valid JSON: {exc}"]
        values.append(value)
        if len(values) > MAX_TEXT_TOOL_CALLS:
            return _items(values)  # too many calls: the parse reports the limit


@dataclass(frozen=True, slots=True)
class _Block:
    end: int
    items: list[ParsedCall | str]


_NON_SPACE = re.compile(r"\S")


class _Finds:
    """The text being parsed, with memoized searches for the closing tags.

    Tag blocks are parsed in order, so each search goes forward; memoizing
    keeps a thousand unclosed tags from each searching the rest of the text.
    """

    __slots__ = ("hermes_close", "hermes_open", "llama_end", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.hermes_close = NextFind(text, HERMES_CLOSE)
        self.hermes_open = NextFind(text, HERMES_OPEN)
        self.llama_end = NextFind(text, LLAMA_END)


def _payload_block(text: str, t: int, end_at: int, end: int, what: str) -> _Block | None:
    # The head is found without slicing: prose after a tag must not copy the
    # rest of the text once per tag.
    head = _NON_SPACE.search(text, t, end_at)
    if head is None:
        return _Block(end, [f"empty {what} block"])
    if head.group() not in "{[":
        return None  # prose that mentions the tag
    return _Block(end, _decode_sequence(text[t:end_at]))


def _hermes(finds: _Finds, i: int) -> _Block | None:
    text = finds.text
    t = i + len(HERMES_OPEN)
    close = finds.hermes_close.find(t)
    reopen = finds.hermes_open.find(t)
    if close >= 0 and (reopen < 0 or close < reopen):
        return _payload_block(text, t, close, close + len(HERMES_CLOSE), HERMES_OPEN)
    end = reopen if reopen >= 0 else len(text)
    return _payload_block(text, t, end, end, HERMES_OPEN)


def _mistral(finds: _Finds, i: int) -> _Block | None:
    text = finds.text
    t = i + len(MISTRAL_TAG)
    n = len(text)
    head = _NON_SPACE.search(text, t)
    if head is None:
        return _Block(n, [f"empty {MISTRAL_TAG} block"])
    j = head.start()
    if text[j] in "{[":
        try:
            value, end = raw_decode(text, j)
        except ValueError as exc:
            return _Block(n, [f"not valid JSON: {exc}"])
        return _Block(end, _items([value]))
    m = _MISTRAL_NAME.match(text, t)
    if m is None:
        return None
    try:
        args, end = raw_decode(text, m.end())
    except ValueError as exc:
        return _Block(n, [f'arguments of "{m.group(1)}" are not valid JSON: {exc}'])
    return _Block(end, [_item({"name": m.group(1), "arguments": args})])


def _llama(finds: _Finds, i: int) -> _Block | None:
    text = finds.text
    t = i + len(LLAMA_TAG)
    eom = finds.llama_end.find(t)
    if eom >= 0:
        return _payload_block(text, t, eom, eom + len(LLAMA_END), LLAMA_TAG)
    return _payload_block(text, t, len(text), len(text), LLAMA_TAG)


_TAG_PARSERS = {HERMES_OPEN: _hermes, MISTRAL_TAG: _mistral, LLAMA_TAG: _llama}


def _cleaned(text: str, spans: Sequence[tuple[int, int]]) -> str:
    if not spans:
        return text
    pieces: list[str] = []
    prev = 0
    for k, (start, end) in enumerate(spans):
        piece = text[prev:start]
        if k:
            piece = piece.lstrip()
        piece = piece.rstrip()
        if piece:
            pieces.append(piece)
        prev = end
    tail = text[prev:].lstrip()
    if tail:
        pieces.append(tail)
    return "\n".join(pieces)


def _fence(text: str, i: int, fenced: bool, in_code: bool) -> tuple[_Block | None, int, bool]:
    """A fence at `i`: a block of calls, a JSON block that is not one (skipped whole),
    or the start or end of a code block. Returns the block (None: none), where the
    scan goes on when there is none, and whether the scan is now in code."""
    pos = i + len(FENCE)
    if in_code or not fenced:
        return None, pos, not in_code
    n = len(text)
    fence = FenceScan(i)
    fence_end = fence.advance(text, n)
    if fence_end is None and fence.stage == 2:
        fence_end = n  # unclosed: a call only if the rest is one
    values = None
    if fence_end is not None and fence.stage == 2:
        values = block_values(fence.content(text, fence_end))
    if fence_end is not None and values is not None:
        return _Block(fence_end, _items(values)), pos, in_code
    if fence_end is not None and fence.is_block:
        return None, fence_end, in_code  # a closed JSON block that is not a call
    return None, pos, True  # any other fence opens a code block


def _take_calls(
    items: Sequence[ParsedCall | str], number: int, calls: list[ParsedCall], errors: list[str]
) -> int:
    """Add a block's calls to `calls` and its problems to `errors`, numbering the calls
    on from `number`; returns the number of the last one."""
    for item in items:
        number += 1
        if number > MAX_TEXT_TOOL_CALLS:
            errors.append(f"more than {MAX_TEXT_TOOL_CALLS} tool calls in one answer")
            break
        if isinstance(item, str):
            errors.append(f"tool call {number}: {item}")
            continue
        calls.append(item)
        if item.arguments_error is not None:
            errors.append(f'tool call {number} ("{item.name}"): {item.arguments_error}')
    return number


def parse_tool_text(
    text: str,
    formats: Sequence[str] = DEFAULT_FORMATS,
    *,
    max_candidate: int = MAX_TOOL_CANDIDATE_CHARS,
    budget: CandidateBudget | None = None,
) -> ParseResult:
    """Split `text` into content and tool calls (see the module docstring for the rules).

    `max_candidate` and `budget` are the streaming filter's (`ToolTextFilter`):
    both must count the same for the filter never to show markup.
    """
    syntax = syntax_for(formats)
    if not syntax.active or not text:
        return ParseResult(cleaned=text)
    budget = budget or CandidateBudget()
    calls: list[ParsedCall] = []
    errors: list[str] = []
    spans: list[tuple[int, int]] = []
    n = len(text)
    pos = number = 0
    in_code = False
    finds = _Finds(text)
    lines = LineStarts()
    starts = StartFinder(syntax)
    while pos < n:
        i = starts.find(text, pos, final=True, in_code=in_code)
        if i < 0:
            break
        budget.steps += 1
        line_start = lines.at(text, i)
        kind, tag = syntax.classify(text, i, line_start, final=True, in_code=in_code)
        block: _Block | None = None
        pos = i + 1
        cost = 0
        if kind is Start.NONE:
            continue
        if kind is Start.TAG:
            block = _TAG_PARSERS[tag](finds, i)
            pos = i + len(tag)
        elif kind is Start.BARE:
            bare = BareScan(i, max_candidate)
            end = bare.advance(text, n, final=True)
            if end == OVER:
                break  # the filter showed it and all that follows: content
            if end == FAILED:
                cost = bare.cost
            else:
                pos = end
                values = call_values(bare.value)
                if values is not None:
                    block = _Block(end, _items(values))
        elif kind is Start.FENCE:
            block, pos, in_code = _fence(text, i, syntax.fenced, in_code)
        if block is None:
            if not budget.charge(cost):
                break  # past the budget the rest is content
            continue
        spans.append((i, block.end))
        pos = block.end
        number = _take_calls(block.items, number, calls, errors)
        if errors:
            break  # the answer fails on its first error: nothing after it matters
    return ParseResult(
        calls=tuple(calls),
        cleaned=_cleaned(text, spans),
        candidate_found=bool(spans),
        errors=tuple(errors),
    )
