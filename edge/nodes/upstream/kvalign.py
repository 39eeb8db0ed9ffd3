"""Which of a prompt's tokens, as its model server tokenized it, each of the edge's prefix
blocks needs: the alignment between the edge's rendering and the server's prompt.

The edge keys a prompt by blocks of PREFIX_BLOCK_CHARS characters of one
canonical rendering (`edge.api.fingerprint`: the model, the tools, then each
message's role, name, text, other parts and tool calls, each field with its
length); the server caches blocks of tokens of its own rendering (the
model's chat template applied to the messages). The two share the messages'
text, verbatim, and little else.

`pieces` renders a RunRequest as the edge does, in pieces, each message's text
(a string content, or each text part) marked as an *anchor*; `verified` checks
that the rendering hashes to the request's own `prefix_blocks`
(`edge.prefixchain`, from its `cache_salt`): a request the node would render
otherwise is not aligned at all.

`needed_tokens` finds each anchor of at least MIN_ANCHOR_CHARS characters in
the server's prompt text (the tokens' bytes, `edge.nodes.upstream.tokentext`),
in order, each after the one before (a text the template changes, trims or
escapes is not found: it counts as structure). Every character of the edge's
rendering then stands at a place in the server's text:

- a character of a found anchor, at its own place;
- any other (the model's name, the tools, roles, names, lengths, other parts,
  tool calls, a text not found): at the start of the next found anchor, or at
  the end of the prompt after the last. The template renders a message's
  structure before its text and after the text before it, so the tokens up to
  there hold whatever the server made of those characters.

Edge block i needs the server's tokens up to the place of its last character:
`needed_tokens` answers that count per block, monotone. The rule is
conservative: a block is never said to need fewer tokens than the server put
before its last character (unless a text is found at a wrong place, which
needs MIN_ANCHOR_CHARS characters of it earlier in the template's own text).

Pure: a request and token bytes in, counts out. Linear in the rendering and the
prompt (one search per anchor, each from the last).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Final

import msgspec

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import MAX_PREFIX_BLOCKS, PREFIX_BLOCK_CHARS
from edge.prefixchain import BlockChain

__all__ = ["MIN_ANCHOR_CHARS", "Piece", "needed_tokens", "pieces", "verified"]

# A message's text shorter than this is not looked for in the server's prompt: a short
# text may occur in the template's own words first.
MIN_ANCHOR_CHARS: Final = 16

_canonical = msgspec.json.Encoder(order="sorted").encode


@dataclass(frozen=True, slots=True)
class Piece:
    """A piece of the edge's rendering; `anchor`: text the server's prompt holds as is."""

    text: str
    anchor: bool = False


def _field(tag: str, value: str, anchor: bool = False) -> Iterator[Piece]:
    yield Piece(f"{tag}{len(value)}:")
    yield Piece(value, anchor)


def _json(text: str) -> str:
    """A JSON text as the edge renders its value: canonical (keys sorted, no spaces)."""
    return _canonical(msgspec.json.decode(text)).decode()


def _content(message: pb.Message) -> Iterator[Piece]:
    if message.content is not None:
        yield from _field("C", message.content, anchor=True)
        return
    parts = message.parts
    i, n = 0, len(parts)
    while i < n:
        if parts[i].type != "text":
            yield from _field("P", _json(parts[i].json))
            i += 1
            continue
        j = i
        while j < n and parts[j].type == "text":
            j += 1
        yield Piece(f"C{sum(len(p.text) for p in parts[i:j])}:")
        for part in parts[i:j]:
            yield Piece(part.text, anchor=True)
        i = j


def pieces(request: pb.RunRequest) -> list[Piece]:
    """`request`'s prompt as the edge renders it (`edge.api.fingerprint.render`), in
    pieces, the messages' text marked. ValueError: a part or schema that is not JSON."""
    out = list(_field("M", request.model))
    for tool in request.tools:
        out += _field("T", tool.name)
        out += _field("", tool.description)
        out += _field("", _json(tool.parameters_json) if tool.parameters_json else "")
    for message in request.messages:
        out += _field("R", message.role)
        out += _field("N", message.name)
        out += _content(message)
        for call in message.tool_calls:
            out += _field("K", call.id)
            out += _field("", call.name)
            out += _field("", call.arguments)
        if message.tool_call_id:
            out += _field("I", message.tool_call_id)
    return out


def verified(request: pb.RunRequest, rendered: Sequence[Piece]) -> bool:
    """Whether `rendered` is the rendering the edge hashed into `request.prefix_blocks`
    (and counted in `prompt_chars`), from the request's `cache_salt`."""
    chain = BlockChain(PREFIX_BLOCK_CHARS, MAX_PREFIX_BLOCKS, request.cache_salt)
    for piece in rendered:
        chain.feed(piece.text)
    return chain.chars == request.prompt_chars and chain.blocks.tolist() == list(
        request.prefix_blocks
    )


@dataclass(slots=True)
class _Span:
    """A piece's characters in the edge's rendering, and where a found anchor stands in
    the server's text (None: not found, or not an anchor)."""

    start: int
    piece: Piece
    at: int | None


def _spans(rendered: Sequence[Piece], text: bytes) -> list[_Span]:
    spans: list[_Span] = []
    chars = found_end = 0
    for piece in rendered:
        at = None
        if piece.anchor and len(piece.text) >= MIN_ANCHOR_CHARS:
            data = piece.text.encode("utf-8", "surrogatepass")
            if (place := text.find(data, found_end)) >= 0:
                at, found_end = place, place + len(data)
        spans.append(_Span(chars, piece, at))
        chars += len(piece.text)
    return spans


def needed_tokens(
    rendered: Sequence[Piece], tokens: Sequence[bytes], blocks: int, block_chars: int
) -> list[int]:
    """For each of the edge's first `blocks` blocks of `block_chars` characters, how many
    of the server's `tokens` (each token's bytes, in order) it needs (the module doc):
    a non-decreasing list of `blocks` counts."""
    text = b"".join(tokens)
    ends = list(accumulate(len(t) for t in tokens))
    spans = _spans(rendered, text)
    # Where a character outside a found anchor stands: the next found anchor's start.
    nexts = [0] * len(spans)
    place = len(text)
    for k in range(len(spans) - 1, -1, -1):
        nexts[k] = place
        if (at := spans[k].at) is not None:
            place = at
    counts: list[int] = []
    k = 0
    # Inside the current anchor: characters and their UTF-8 bytes counted so far.
    done_chars = done_bytes = 0
    for i in range(blocks):
        last = (i + 1) * block_chars - 1  # the block's last character
        while k < len(spans) - 1 and spans[k + 1].start <= last:
            k += 1
            done_chars = done_bytes = 0
        span = spans[k]
        if span.at is None:
            place = nexts[k]
        else:
            upto = last - span.start + 1
            done_bytes += len(span.piece.text[done_chars:upto].encode("utf-8", "surrogatepass"))
            done_chars = upto
            place = span.at + done_bytes
        counts.append(min(bisect_left(ends, place) + 1, len(tokens)) if place > 0 else 0)
    return counts
