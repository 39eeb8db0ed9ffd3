"""The chained block hashes of a prompt's rendering: the one rule the edge's prefix
fingerprint (`edge.api.fingerprint`) and iop-node's KV block mapping
(`edge.nodes.upstream.kvmap`) share, so that what a node reports is keyed as the
edge routes.

The text is cut into blocks of `block_chars` characters (a partial last block is
not hashed) and each block's hash covers every block before it:
hash(i) = BLAKE2b-64(hash(i-1) || UTF-8 of block i), the chain starting from the
scope's own hash (a KV-cache scope: its `cache_salt`; "" shared: from nothing), so
two texts share their first k hashes exactly when (hash collisions aside) they share
their first k blocks and their scope. Each hash is an unsigned 64-bit integer
(big-endian digest). Past `max_blocks` whole blocks no more hashes are made, and the
rest is only counted.

It lives here, under both, because neither side may import the other's layer
(`edge.api` beside `edge.contract`, `edge.nodes` above both). Pure: text in, hashes
out; it imports nothing of the edge.
"""

from __future__ import annotations

import hashlib
from array import array

__all__ = ["BlockChain"]


class BlockChain:
    """Chains the hashes of whole blocks of the text fed to it, in order (the module
    doc's rule): `blocks` so far, and `chars`, every character fed."""

    __slots__ = ("_block_chars", "_max_blocks", "_pending", "_pending_chars", "_previous",
                 "blocks", "chars")  # fmt: skip

    def __init__(self, block_chars: int, max_blocks: int, scope: str = "") -> None:
        self._block_chars = block_chars
        self._max_blocks = max_blocks
        # The text after the last whole block: fewer than block_chars characters, as fed.
        self._pending: list[str] = []
        self._pending_chars = 0
        # The chain starts from the scope's own hash: two scopes share no block.
        self._previous = (
            hashlib.blake2b(scope.encode(), digest_size=8, person=b"iop-scope").digest()
            if scope
            else b""
        )
        self.blocks: array[int] = array("Q")
        self.chars = 0

    def feed(self, text: str) -> None:
        self.chars += len(text)
        if len(self.blocks) >= self._max_blocks or not text:
            return  # only counted from here
        size = self._block_chars
        start = 0
        if self._pending:
            need = size - self._pending_chars
            if len(text) < need:
                self._pending.append(text)
                self._pending_chars += len(text)
                return
            self._pending.append(text[:need])
            self._block("".join(self._pending))
            self._pending.clear()
            self._pending_chars = 0
            start = need
        end = len(text)
        room = self._max_blocks - len(self.blocks)
        whole = min((end - start) // size, room)
        if whole:
            self._blocks(text, start, whole)
            start += whole * size
        if start < end and whole < room:
            self._pending.append(text[start:])
            self._pending_chars = end - start

    def _block(self, block: str) -> None:
        self._blocks(block, 0, 1)

    def _blocks(self, text: str, start: int, count: int) -> None:
        """Hash `count` whole blocks of `text` from `start` (the hot loop: locals only)."""
        size = self._block_chars
        previous = self._previous
        append = self.blocks.append
        blake2b, from_bytes = hashlib.blake2b, int.from_bytes
        for offset in range(start, start + count * size, size):
            data = text[offset : offset + size].encode("utf-8", "surrogatepass")
            previous = blake2b(previous + data, digest_size=8).digest()
            append(from_bytes(previous, "big"))
        self._previous = previous
