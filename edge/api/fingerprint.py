"""A request's prefix fingerprint: one canonical rendering of its prompt, cut into blocks
whose hashes are chained, for cache-aware routing.

A node's KV cache holds the prompts it computed, by prefix: a request whose
first blocks another request already sent to a node starts there with those
blocks' prefill done. The edge cannot tokenize for every model, so it keys a
prompt by one rendering of what the node is given, in order:

    M<n>:<model>
    T<n>:<name><n>:<description><n>:<parameters, canonical JSON>     one per tool
    R<n>:<role>N<n>:<name>                                           one per message,
      C<n>:<text>       a run of text (a string content, or text parts back to back)
      P<n>:<json>       a part of any other type, as canonical JSON
      K<n>:<id><n>:<name><n>:<arguments>                             one per tool call
      I<n>:<tool_call_id>

where <n> is the decimal length in characters of the field that follows, so
no field can pass for another; canonical JSON has sorted keys and no spaces
(msgspec). A string content and an array of text parts that concatenate to
the same string render the same (a client's chunking is not the prompt);
everything else of a part (its `cache_control`, say) is not. Sampling
fields and `reasoning_content` are not part of it: they do not change what
a node caches of the conversation.

The rendering is cut into blocks of `block_chars` characters whose hashes are
chained (`edge.prefixchain`: each covers every block before it, a partial last
block is not hashed), so two prompts share their first k hashes exactly when
they share their first k blocks, and a conversation's next turn shares every
whole block of the turn before.

Linear in the request's size and streamed: fields are fed in order to one
hasher that keeps less than a block of text pending; nothing holds the
whole rendering (a non-text part is rendered alone, one part at a time).
Past `max_blocks` whole blocks no more hashes are made, and the rest is only
counted. Runs in the request's parse thread, off the event loop, once per
request (`edge.node.wire.prepare_run_request`).

Pure: values in, hashes out. The block size and bound are the contract's
(`edge.contract.prefix`), passed in by the caller: this layer does not
import that one.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import msgspec

from edge.api.request import ChatMessage, ChatRequest, ContentPart
from edge.prefixchain import BlockChain

__all__ = ["Fingerprint", "fingerprint", "render"]

_encode = msgspec.json.Encoder(order="sorted").encode


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A prompt's chained block hashes (at most the caller's `max_blocks`), and the
    length of its rendering in characters."""

    # Unsigned 64-bit hashes, block 0 first (an array: 8 bytes each, no objects).
    blocks: array[int]
    chars: int

    @property
    def first(self) -> int | None:
        """The first block's hash (the prompt's start: its model, tools, system prompt);
        None for a prompt shorter than one block."""
        return self.blocks[0] if self.blocks else None


def _field(tag: str, value: str) -> Iterator[str]:
    yield f"{tag}{len(value)}:"
    yield value


def _content(message: ChatMessage) -> Iterator[str]:
    """The message's content as runs of text and non-text parts."""
    if message.content is not None:
        yield from _field("C", message.content)
        return
    parts: Sequence[ContentPart] = message.parts
    i, n = 0, len(parts)
    while i < n:
        if parts[i].type != "text":
            yield from _field("P", _encode(parts[i].raw).decode())
            i += 1
            continue
        j, length = i, 0
        while j < n and parts[j].type == "text":
            length += len(parts[j].text)
            j += 1
        yield f"C{length}:"
        for part in parts[i:j]:
            yield part.text
        i = j


def render(request: ChatRequest, model: str) -> Iterator[str]:
    """The canonical rendering of `request`'s prompt as `model` is given it, in pieces
    (see the module doc); joined, they are the text the blocks are cut from."""
    yield from _field("M", model)
    for tool in request.tools.tools:
        parameters = "" if tool.parameters is None else _encode(tool.parameters).decode()
        yield from _field("T", tool.name)
        yield from _field("", tool.description)
        yield from _field("", parameters)
    for message in request.messages:
        yield from _field("R", message.role)
        yield from _field("N", message.name or "")
        yield from _content(message)
        for call in message.tool_calls:
            yield from _field("K", call.id)
            yield from _field("", call.name)
            yield from _field("", call.arguments)
        if message.tool_call_id is not None:
            yield from _field("I", message.tool_call_id)


def fingerprint(
    request: ChatRequest, model: str, *, block_chars: int, max_blocks: int, scope: str = ""
) -> Fingerprint:
    """`request`'s prefix fingerprint as `model` is given it: the chained hashes of the
    first `max_blocks` whole blocks of `block_chars` characters of its rendering.
    `scope` (a KV-cache scope: "" shared) seeds the chain, so the same prompt in two
    scopes shares no block (its blocks cut at the same places). Linear in the request's
    size: run it off the event loop."""
    hasher = BlockChain(block_chars, max_blocks, scope)
    for piece in render(request, model):
        hasher.feed(piece)
    return Fingerprint(hasher.blocks, hasher.chars)
