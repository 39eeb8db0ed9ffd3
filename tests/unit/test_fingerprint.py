"""The prefix fingerprint (edge.api.fingerprint): one rendering of a prompt, whatever its
JSON's key order or its content's chunking, and chained hashes of its blocks.

Small blocks (8 characters) make short prompts span many blocks; the
contract's sizes are checked once, through the RunRequest the edge sends.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from edge.api.fingerprint import fingerprint, render
from edge.api.request import ChatRequest, parse_chat_request
from edge.api.surfaces import CHAT, MESSAGES, RESPONSES
from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import MAX_PREFIX_BLOCKS, PREFIX_BLOCK_CHARS
from edge.node.wire import cache_salt, prepare_run_request
from edge.prefixchain import BlockChain

BLOCK = 8
_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)


def _naive(text: str, block: int = BLOCK, limit: int = 1 << 30) -> list[int]:
    """The chained hashes of `text`'s whole blocks, computed the plain way."""
    hashes, previous = [], b""
    for start in range(0, len(text) - block + 1, block):
        if len(hashes) == limit:
            break
        previous = hashlib.blake2b(
            previous + text[start : start + block].encode("utf-8", "surrogatepass"),
            digest_size=8,
        ).digest()
        hashes.append(int.from_bytes(previous, "big"))
    return hashes


def _fp(request: ChatRequest, block: int = BLOCK) -> list[int]:
    return fingerprint(
        request, request.model, block_chars=block, max_blocks=1 << 20
    ).blocks.tolist()


def _shuffled(value: Any, rng: random.Random) -> Any:
    """`value` with every object's keys in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


def _chunks(text: str, cuts: list[int]) -> list[dict[str, Any]]:
    """`text` as text parts cut at `cuts`."""
    points = sorted({min(c, len(text)) for c in cuts})
    pieces, start = [], 0
    for point in [*points, len(text)]:
        pieces.append(text[start:point])
        start = point
    return [{"type": "text", "text": p} for p in pieces]


@st.composite
def _bodies(draw: st.DrawFn) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": draw(_TEXT)}]
    for _ in range(draw(st.integers(1, 4))):
        messages.append({"role": "user", "content": draw(_TEXT)})
        if draw(st.booleans()):
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": draw(_TEXT)},
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": "call_1", "content": draw(_TEXT)})
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if draw(st.booleans()):
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "description": draw(_TEXT),
                    "parameters": {
                        "type": "object",
                        "properties": {"x": {"type": "string"}, "y": {"type": "integer"}},
                        "required": ["x"],
                    },
                },
            }
        ]
    return body


def _parse(body: dict[str, Any]) -> ChatRequest:
    return parse_chat_request(json.dumps(body).encode())


@given(_bodies(), st.randoms(use_true_random=False), st.lists(st.integers(0, 40), max_size=5))
def test_key_order_and_text_chunking_do_not_change_the_fingerprint(
    body: dict[str, Any], rng: random.Random, cuts: list[int]
) -> None:
    """The same prompt has the same fingerprint whatever the order of its JSON's keys
    (tool schemas included) and however its text is cut into text parts."""
    reference = _fp(_parse(body))
    again = _shuffled(body, rng)
    for message in again["messages"]:
        if isinstance(message.get("content"), str) and message["content"]:
            message["content"] = _chunks(message["content"], cuts)
    assert _fp(_parse(again)) == reference
    assert "".join(render(_parse(again), "m")) == "".join(render(_parse(body), "m"))


@given(_bodies(), _bodies())
def test_blocks_are_equal_exactly_as_far_as_the_renderings_are(
    a: dict[str, Any], b: dict[str, Any]
) -> None:
    """Block k's hash of two prompts is the same exactly when their renderings agree up to
    the end of block k; the rendering differs where the prompt does (fields are
    length-prefixed); the hashes are those of the plain chained computation."""
    ra, rb = _parse(a), _parse(b)
    text_a, text_b = "".join(render(ra, "m")), "".join(render(rb, "m"))
    fa, fb = _fp(ra), _fp(rb)
    assert fa == _naive(text_a)
    assert fb == _naive(text_b)
    for k in range(min(len(fa), len(fb))):
        assert (fa[k] == fb[k]) == (text_a[: (k + 1) * BLOCK] == text_b[: (k + 1) * BLOCK])
    if ra.messages != rb.messages or ra.tools.tools != rb.tools.tools:
        assert text_a != text_b


@given(_bodies(), _TEXT)
def test_the_next_turn_keeps_every_whole_block_of_the_turn_before(
    body: dict[str, Any], reply: str
) -> None:
    """A conversation's next turn (its history plus new messages) starts with every
    whole block of the turn before: its prefix is found cached."""
    turn = _fp(_parse(body))
    body["messages"] = [
        *body["messages"],
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "next"},
    ]
    assert _fp(_parse(body))[: len(turn)] == turn


@given(st.lists(_TEXT, max_size=30), st.integers(1, 12), st.integers(0, 6))
def test_the_hasher_is_the_same_however_the_text_is_fed(
    pieces: list[str], block: int, limit: int
) -> None:
    """Feeding the text in any pieces gives the hashes of the whole text, at most
    `max_blocks` of them, and counts every character."""
    hasher = BlockChain(block, limit)
    for piece in pieces:
        hasher.feed(piece)
    text = "".join(pieces)
    assert hasher.blocks.tolist() == _naive(text, block, limit)
    assert hasher.chars == len(text)


def test_non_text_parts_render_by_their_canonical_json() -> None:
    """A part of another type is its whole JSON, keys sorted: the same part in any key
    order is the same prompt, another image is another."""

    def body(part: dict[str, Any]) -> ChatRequest:
        return _parse({"model": "m", "messages": [{"role": "user", "content": [part]}]})

    url_first = {"type": "image_url", "image_url": {"url": "https://a/x.png", "detail": "low"}}
    type_last = {"image_url": {"detail": "low", "url": "https://a/x.png"}, "type": "image_url"}
    other = {"type": "image_url", "image_url": {"url": "https://a/y.png", "detail": "low"}}
    assert _fp(body(url_first)) == _fp(body(type_last))
    assert "".join(render(body(url_first), "m")) != "".join(render(body(other), "m"))


def test_the_run_request_carries_the_contracts_blocks_and_the_prompts_length() -> None:
    """The RunRequest the edge sends has the fingerprint at the contract's block size,
    at most MAX_PREFIX_BLOCKS hashes however long the prompt, and the rendering's
    whole length."""
    long = "x" * (PREFIX_BLOCK_CHARS * (MAX_PREFIX_BLOCKS + 10))
    request = _parse({"model": "m", "messages": [{"role": "user", "content": long}]})
    prepared = prepare_run_request(request, run_id="r", model="m")
    sent = pb.RunRequest.FromString(prepared.body)
    assert prepared.prefix is not None
    assert len(sent.prefix_blocks) == MAX_PREFIX_BLOCKS
    assert sent.prefix_blocks == prepared.prefix.blocks.tolist()
    text_chars = len("".join(render(request, "m")))
    assert sent.prompt_chars == prepared.prefix.chars == text_chars
    short = _parse({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    tiny = prepare_run_request(short, run_id="r", model="m")
    assert pb.RunRequest.FromString(tiny.body).prefix_blocks == []
    assert tiny.prefix is not None
    assert tiny.prefix.first is None


def test_the_three_apis_give_one_prompt_one_fingerprint() -> None:
    """The same conversation sent to chat completions, responses (`instructions`, a
    string input) and messages (`system`, text blocks) has one fingerprint: a client
    moving between the APIs finds its prefix cached."""
    system = "You are terse and exact. " * 20
    chat = CHAT.parse(
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "hello there"},
                ],
            }
        ).encode()
    )
    responses = RESPONSES.parse(
        json.dumps({"model": "m", "instructions": system, "input": "hello there"}).encode()
    )
    blocks = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    messages = MESSAGES.parse(
        json.dumps(
            {
                "model": "m",
                "max_tokens": 10,
                "system": system,
                "messages": [{"role": "user", "content": blocks}],
            }
        ).encode()
    )
    prints = [_fp(api.chat, PREFIX_BLOCK_CHARS) for api in (chat, responses, messages)]
    assert prints[0]
    assert prints[0] == prints[1] == prints[2]


@given(_TEXT, _TEXT, st.text(min_size=1, max_size=20))
def test_a_scope_shares_no_block_with_another_and_keeps_the_cuts(
    system: str, user: str, scope: str
) -> None:
    """The same prompt in two scopes (a key's own, "" shared) shares no block hash, and
    is cut into the same number of blocks of the same characters; its RunRequest names
    the scope by a salt that is not the scope itself, and none when shared."""
    request = _parse({"model": "m", "messages": [
        {"role": "system", "content": system * 8 + "a system prompt"},
        {"role": "user", "content": user or "hi"}]})  # fmt: skip
    shared = fingerprint(request, "m", block_chars=BLOCK, max_blocks=64)
    scoped = fingerprint(request, "m", block_chars=BLOCK, max_blocks=64, scope=scope)
    assert scoped.chars == shared.chars
    assert len(scoped.blocks) == len(shared.blocks)
    assert not set(scoped.blocks) & set(shared.blocks)
    salted = pb.RunRequest.FromString(
        prepare_run_request(request, run_id="r", model="m", cache_scope=scope).body
    )
    assert salted.cache_salt == cache_salt(scope) != scope
    plain = pb.RunRequest.FromString(prepare_run_request(request, run_id="r", model="m").body)
    assert plain.cache_salt == ""
