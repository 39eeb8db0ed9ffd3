"""The edge's rendering of a run, as iop-node makes it again, and which of the server's
tokens each of the edge's prefix blocks needs (`edge.nodes.upstream.kvalign`), with the
tokens' text from their vocabulary strings (`edge.nodes.upstream.tokentext`)."""

from __future__ import annotations

import json
from itertools import accumulate
from typing import Any

from hypothesis import given, reject, settings
from hypothesis import strategies as st

from edge.api.fingerprint import render
from edge.api.request import ChatRequest, parse_chat_request
from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import PREFIX_BLOCK_CHARS
from edge.errors import RequestError
from edge.node.wire import prepare_run_request
from edge.nodes.upstream.kvalign import MIN_ANCHOR_CHARS, needed_tokens, pieces, verified
from edge.nodes.upstream.tokentext import token_bytes
from tests.integration.kv_fixtures.chatml import BYTE_TO_CHAR, template, text_of, tokenize

_CHARS = st.characters(min_codepoint=32, max_codepoint=0x2FFF, exclude_categories=("Cs",))
# Texts up to some blocks long: a short text repeated (hypothesis draws short texts).
_TEXT = st.tuples(st.text(_CHARS, max_size=40), st.integers(0, 30)).map(lambda t: t[0] * t[1])
_PART = st.one_of(
    _TEXT.map(lambda t: {"type": "text", "text": t}),
    st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}),
)
_TOOL_CALL = st.fixed_dictionaries({
    "id": st.text(max_size=8), "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": st.just("f"), "arguments": st.just('{"a": 1}')}),
})  # fmt: skip
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": _TEXT}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(_PART, max_size=3)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": _TEXT},
                          optional={"tool_calls": st.lists(_TOOL_CALL, min_size=1, max_size=2),
                                    "name": st.text(max_size=5)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": _TEXT,
                           "tool_call_id": st.text(min_size=1, max_size=6)}),
)  # fmt: skip
_TOOL = {
    "type": "function",
    "function": {"name": "weather", "description": "Weather.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "number"}}}},
}  # fmt: skip


def _chat(body: dict[str, Any]) -> ChatRequest:
    """`body` as the edge parses it (a body it refuses is not an example)."""
    try:
        return parse_chat_request(json.dumps(body).encode())
    except RequestError:
        reject()


def _run(body: dict[str, Any], scope: str = "") -> pb.RunRequest:
    """The RunRequest the edge sends for `body` (its prefix blocks taken from `scope`)."""
    request = _chat(body)
    prepared = prepare_run_request(request, run_id="r", model=body["model"], cache_scope=scope)
    return pb.RunRequest.FromString(prepared.body)


@settings(max_examples=200, deadline=None)
@given(st.lists(_MESSAGE, min_size=1, max_size=5), st.booleans(), st.text(max_size=6))
def test_the_node_renders_a_run_as_the_edge_hashed_it(
    messages: list[dict[str, Any]], tools: bool, scope: str
) -> None:
    """Any request the edge takes (text, parts of other types, tool calls, tool answers,
    names, tools), in any KV-cache scope: the node's rendering of its RunRequest is the
    edge's, character for character, and hashes to the RunRequest's own prefix blocks."""
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if tools:
        body["tools"] = [_TOOL]
    run = _run(body, scope)
    rendered = pieces(run)
    assert "".join(p.text for p in rendered) == "".join(render(_chat(body), "m"))
    assert verified(run, rendered)
    run.prefix_blocks = [b ^ 1 for b in run.prefix_blocks] or [1]
    assert not verified(run, rendered)


def _places(run: pb.RunRequest, server: str, messages: list[dict[str, Any]]) -> list[int]:
    """Where each character of the edge's rendering of `run` stands in the ChatML text
    `server` (in bytes, up to and with it), by the template's own layout: a message's
    long text at its own place, any other character at the next long text's start, or
    at the end."""
    starts, at = [], 0
    for message in messages:
        at += len(f"<|im_start|>{message['role']}\n".encode())
        starts.append(at)
        at += len(text_of(message.get("content")).encode()) + len(b"<|im_end|>\n")
    rendered = pieces(run)
    anchors = []  # (first character in the rendering, its text, its start in `server`)
    chars, texts = 0, iter(starts)
    for piece in rendered:
        if piece.anchor:
            start = next(texts)
            if len(piece.text) >= MIN_ANCHOR_CHARS:
                anchors.append((chars, piece.text, start))
        chars += len(piece.text)
    places = [0] * chars
    upcoming, k = len(server.encode()), chars - 1
    for first, text, start in reversed(anchors):
        while k >= first + len(text):
            places[k] = upcoming
            k -= 1
        places[first : first + len(text)] = [start + e for e in accumulate(
            len(c.encode()) for c in text)]  # fmt: skip
        upcoming, k = start, first - 1
    while k >= 0:
        places[k] = upcoming
        k -= 1
    return places


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), _TEXT),
                min_size=1, max_size=4), st.integers(1, 6))  # fmt: skip
def test_each_block_needs_the_tokens_up_to_its_last_characters_place_however_cut(
    turns: list[tuple[str, str]], cut: int
) -> None:
    """Whatever the conversation and however the server's tokenizer cuts the text (into
    pieces of 1 to 6 bytes, a character cut or not): each edge block needs exactly the
    tokens up to the place of its last character in the server's prompt (a message's
    long text at its own place, anything else at the next long text's start, or the
    prompt's end), so every text character of the block is in those tokens."""
    messages = [{"role": role, "content": content} for role, content in turns]
    run = _run({"model": "m", "messages": messages})
    server = template(messages)
    _, strs = tokenize(server, {}, cut)
    tokens = token_bytes(strs)
    assert b"".join(tokens) == server.encode()
    blocks = len(run.prefix_blocks)
    needed = needed_tokens(pieces(run), tokens, blocks, PREFIX_BLOCK_CHARS)
    places = _places(run, server, messages)
    ends = list(accumulate(len(t) for t in tokens))
    for i, count in enumerate(needed):
        place = places[(i + 1) * PREFIX_BLOCK_CHARS - 1]
        assert ends[count - 1] >= place
        assert count == 1 or ends[count - 2] < place


def test_a_text_the_template_changes_counts_as_structure() -> None:
    """A message's text the server's template trims is not found: its characters need the
    tokens up to the next text found, never fewer than the server put before them."""
    system = "  You are terse. " + "Answer in one line. " * 30
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "q" * 600}]
    run = _run({"model": "m", "messages": messages})
    trimmed = [{"role": "system", "content": system.strip()}, messages[1]]
    server = template(trimmed)
    _, strs = tokenize(server, {}, 4)
    tokens = token_bytes(strs)
    needed = needed_tokens(pieces(run), tokens, len(run.prefix_blocks), PREFIX_BLOCK_CHARS)
    user_start = server.encode().index(b"q" * 600)
    ends = list(accumulate(len(t) for t in tokens))
    system_blocks = len(system) // PREFIX_BLOCK_CHARS
    for count in needed[:system_blocks]:
        assert ends[count - 1] >= user_start


@given(st.text(max_size=300), st.integers(1, 5))
def test_byte_level_token_strings_give_the_texts_bytes(text: str, cut: int) -> None:
    """GPT-2's byte-level strings of any cut of a text's bytes (a character cut or not)
    give the text's bytes back."""
    data = text.encode("utf-8", "surrogatepass")
    strs = ["".join(BYTE_TO_CHAR[b] for b in data[at : at + cut]) for at in range(0, len(data),
            cut)]  # fmt: skip
    assert b"".join(token_bytes(strs)) == data


def test_sentencepiece_token_strings_give_the_texts_bytes() -> None:
    """SentencePiece's `▁` is a space and `<0xNN>` a byte; other pieces are their UTF-8."""
    strs = ["<s>", "▁Hello", "▁wor", "ld", "<0x0A>", "▁é", "<0xE2>", "<0x82>", "<0xAC>"]
    assert b"".join(token_bytes(strs)) == "<s> Hello world\n é€".encode()
