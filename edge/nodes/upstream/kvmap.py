"""The model server's prefix cache as the edge's prefix blocks: what iop-node reports on
Watch (`kv_blocks_stored`, `kv_blocks_evicted`) for a server that publishes its KV
events (`edge.nodes.upstream.kvwire`).

A server caches blocks of `block_size` tokens, each keyed by a hash chained over
its parent's and its tokens; its events name blocks by those hashes and carry
the tokens of the blocks stored. The hashes need not be reproduced (their
algorithm, seed and extra keys differ by server, version and flags): a block
is known here by a *content key* of its own, chained over the same tokens
(BLAKE2b-64: the first block's over its scope, the run's cache salt and model,
and its tokens; each next block's over its parent's key and its tokens), and
an event's hashes are mapped to those keys as they come (`BlockStored` gives
each new block's tokens and its parent's hash).

- `Prompt` (made by `prompt_blocks`, off the loop: it hashes the prompt) is a
  run's prompt as the server will cache it: its full blocks' keys, and for each
  the edge blocks it completes (those whose characters all stand in the tokens
  up to its end: `edge.nodes.upstream.kvalign`). `register` records them; the
  first block's tokens also name the run's scope, which is how a store with no
  parent (a prompt's first block) finds its key: from the scopes of the runs
  registered whose first block has those tokens (one; when several, the one the
  event's own hints name, else none).
- `apply` an event: a store maps its hashes to keys (its parent's known, or the
  first block's scope found) and marks the blocks stored; a removal unmarks
  them; `AllBlocksCleared` resets. A store whose parent is not known (stored
  before iop-node heard the server) is not placed: its blocks stay unknown
  until stored again.
- A block is *reachable* when it is stored and its parent is reachable (or it
  is a first block): what a prompt can find cached. The edge blocks of
  reachable blocks are *claimed*, and those are what the node reports: a
  block reachable again claims its edge blocks, one no longer reachable (its
  removal, or its parent's) gives up its own and its descendants'. vLLM and
  SGLang evict a chain's end first, so a parent's removal rarely leaves a
  child stored; when it does, the child is unreachable until the parent is
  stored again, as in the server's lookup.
- `reset` (a gap the replay could not fill, a new life of the server, a
  cleared cache): nothing is stored; every claim is given up, and every watcher
  gets a snapshot (`BlockLog.reset`). The registrations stay: they say what
  the runs' tokens are, whatever the server holds.

An edge block claimed by several blocks (two renderings of one prompt) is held
while any of them is. The claims go to a `BlockLog` (`log`), from which each
Watch report is made.

Bounded: at most `max_blocks` blocks (the server's and the runs', an LRU in
which a prompt's first blocks are the most recently used: its end is dropped
first; a block dropped takes its descendants with it, which could not be
reached again), at most EDGE_PER_BLOCK edge blocks each, at most
MAX_KV_BLOCKS_PER_REPORT claims (more are not claimed), FIRSTS_KEPT first
blocks' scopes. Each event costs its blocks (and the chain above the deepest
of them, to keep the LRU's order), a registration its prompt's blocks.

Pure: no asyncio, no sockets.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from edge.contract.prefix import MAX_KV_BLOCKS_PER_REPORT
from edge.nodes.blocklog import BlockLog
from edge.nodes.upstream.kvwire import BlockHash, Cleared, Event, Removed, Stored

__all__ = ["EDGE_PER_BLOCK", "FIRSTS_KEPT", "KVMap", "Prompt", "Scope", "prompt_blocks"]

# A run's KV-cache scope as the server tells it apart: its cache salt and its model.
Scope = tuple[str, str]
# The edge blocks one server block completes, kept at most (several runs' renderings).
EDGE_PER_BLOCK: Final = 16
# The first blocks whose runs' scopes are kept (an LRU).
FIRSTS_KEPT: Final = 4096


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return array("I", tokens).tobytes()


def first_digest(tokens: Sequence[int]) -> int:
    """A first block's tokens, as the key of its runs' scopes."""
    digest = hashlib.blake2b(_token_bytes(tokens), digest_size=8, person=b"iop-kv-first")
    return int.from_bytes(digest.digest(), "big")


def root_key(scope: Scope, tokens: Sequence[int]) -> int:
    salt, model = scope
    head = f"{len(salt)}:{salt}{len(model)}:{model}".encode()
    digest = hashlib.blake2b(head + _token_bytes(tokens), digest_size=8, person=b"iop-kv-root")
    return int.from_bytes(digest.digest(), "big")


def child_key(parent: int, tokens: Sequence[int]) -> int:
    data = parent.to_bytes(8, "big") + _token_bytes(tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"iop-kv").digest(), "big")


@dataclass(frozen=True, slots=True)
class Prompt:
    """A run's prompt as its server caches it (the module doc): the keys of its full
    blocks, and per block the edge blocks it completes."""

    scope: Scope
    block_size: int
    first: int
    keys: tuple[int, ...]
    edge: tuple[tuple[int, ...], ...]


def prompt_blocks(
    scope: Scope,
    tokens: Sequence[int],
    block_size: int,
    needed: Sequence[int],
    edge_blocks: Sequence[int],
) -> Prompt:
    """The `Prompt` of `tokens` cut into blocks of `block_size`, where edge block i
    (`edge_blocks[i]`) needs the first `needed[i]` tokens: it is completed by the block
    holding the last of them, and claimed by none when that block is not full."""
    full = len(tokens) // block_size
    keys: list[int] = []
    for j in range(full):
        piece = tokens[j * block_size : (j + 1) * block_size]
        keys.append(root_key(scope, piece) if j == 0 else child_key(keys[-1], piece))
    edge: list[list[int]] = [[] for _ in range(full)]
    for block, count in zip(edge_blocks, needed, strict=True):
        j = max(0, count - 1) // block_size
        if j < full:
            edge[j].append(block)
    first = first_digest(tokens[:block_size]) if full else 0
    return Prompt(scope, block_size, first, tuple(keys), tuple(tuple(e) for e in edge))


class _Block:
    """One server block by its content key (the key is the table's)."""

    __slots__ = ("children", "edge", "hashes", "parent", "reachable")

    def __init__(self, parent: int | None) -> None:
        self.parent = parent
        self.children: set[int] | None = None
        self.edge: tuple[int, ...] = ()
        # The server's hashes of it that are stored now (one, but for a hash reused).
        self.hashes: list[BlockHash] = []
        self.reachable = False


class _Claims:
    """The edge blocks claimed, each with the number of reachable blocks that claim it,
    and the log of their changes the Watch reports are made from."""

    __slots__ = ("held", "log")

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.log = BlockLog(MAX_KV_BLOCKS_PER_REPORT, self.held.keys)

    def claim(self, edge: Iterable[int]) -> bool:
        held, log = self.held, self.log
        changed = False
        for e in edge:
            if (count := held.get(e)) is not None:
                held[e] = count + 1
            elif len(held) < MAX_KV_BLOCKS_PER_REPORT:
                held[e] = 1
                log.stored(e)
                changed = True
        return changed

    def unclaim(self, edge: Iterable[int]) -> bool:
        held, log = self.held, self.log
        changed = False
        for e in edge:
            count = held.get(e)
            if count is None:
                continue
            if count > 1:
                held[e] = count - 1
            else:
                del held[e]
                log.evicted(e)
                changed = True
        return changed

    def reset(self) -> None:
        self.held.clear()
        self.log.reset()


class _Table:
    """The blocks by content key, an LRU whose first blocks are the most recently used,
    and the server's hashes of the stored ones."""

    __slots__ = ("blocks", "by_hash", "max_blocks")

    def __init__(self, max_blocks: int) -> None:
        self.blocks: OrderedDict[int, _Block] = OrderedDict()
        self.by_hash: dict[BlockHash, int] = {}
        self.max_blocks = max_blocks

    def new(self, key: int, parent: int | None) -> _Block:
        block = self.blocks[key] = _Block(parent)
        if parent is not None and (up := self.blocks.get(parent)) is not None:
            if up.children is None:
                up.children = set()
            up.children.add(key)
        return block

    def parent_reachable(self, block: _Block) -> bool:
        if block.parent is None:
            return True
        parent = self.blocks.get(block.parent)
        return parent is not None and parent.reachable

    def touch(self, key: int) -> None:
        """`key` and its chain up to the first block become the most recently used, the
        first block last (so a chain's end is dropped first)."""
        blocks = self.blocks
        at: int | None = key
        while at is not None and (block := blocks.get(at)) is not None:
            blocks.move_to_end(at)
            at = block.parent

    def trim(self, claims: _Claims) -> None:
        blocks = self.blocks
        while len(blocks) > self.max_blocks:
            key, block = blocks.popitem(last=False)
            self._drop(key, block, claims)

    def _drop(self, key: int, block: _Block, claims: _Claims) -> None:
        """Forget `block` (out of the table already) and its descendants: their hashes
        and claims go, and no store can reach them again."""
        up = self.blocks.get(block.parent) if block.parent is not None else None
        if up is not None and up.children is not None:
            up.children.discard(key)
        stack = [block]
        while stack:
            one = stack.pop()
            if one.reachable:
                claims.unclaim(one.edge)
            for h in one.hashes:
                self.by_hash.pop(h, None)
            for child in one.children or ():
                if (dropped := self.blocks.pop(child, None)) is not None:
                    stack.append(dropped)


class KVMap:
    """The server's cached blocks as the edge's (the module doc)."""

    def __init__(self, block_size: int, max_blocks: int) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError("a block holds a token at least, and the table a block")
        self.block_size = block_size
        self._table = _Table(max_blocks)
        self._firsts: OrderedDict[int, set[Scope]] = OrderedDict()
        self._claims = _Claims()
        self.log = self._claims.log
        # Blocks of stores that could not be placed (an unknown parent or first block).
        self.unplaced = 0

    def __len__(self) -> int:
        return len(self._table.blocks)

    @property
    def claimed(self) -> int:
        """Edge blocks claimed now (reported held)."""
        return len(self._claims.held)

    def stored(self) -> int:
        """Server blocks known stored now."""
        return len(self._table.by_hash)

    # --- runs ----------------------------------------------------------------------

    def register(self, prompt: Prompt) -> bool:
        """Record a run's prompt (before it is sent); whether claims changed (blocks of
        it cached already claim its edge blocks at once)."""
        if prompt.block_size != self.block_size or not prompt.keys:
            return False
        firsts = self._firsts
        firsts.setdefault(prompt.first, set()).add(prompt.scope)
        firsts.move_to_end(prompt.first)
        while len(firsts) > FIRSTS_KEPT:
            firsts.popitem(last=False)
        table = self._table
        changed = False
        parent: int | None = None
        for key, edge in zip(prompt.keys, prompt.edge, strict=True):
            block = table.blocks.get(key) or table.new(key, parent)
            new = [e for e in edge if e not in block.edge][: EDGE_PER_BLOCK - len(block.edge)]
            if new:
                block.edge += tuple(new)
                if block.reachable:
                    changed |= self._claims.claim(new)
            parent = key
        table.touch(prompt.keys[-1])
        table.trim(self._claims)
        return changed

    # --- the server's events ---------------------------------------------------------

    def apply(self, event: Event) -> bool:
        """One event of the server's; whether claims changed."""
        if isinstance(event, Stored):
            return self._stored(event)
        if isinstance(event, Removed):
            changed = False
            for h in event.hashes:
                changed |= self._removed(h)
            return changed
        assert isinstance(event, Cleared)
        self.reset()
        return True

    def reset(self) -> None:
        """Nothing is stored (the module doc): claims given up, a snapshot for every
        watcher; the runs' registrations stay."""
        for block in self._table.blocks.values():
            block.hashes = []
            block.reachable = False
        self._table.by_hash.clear()
        self._claims.reset()

    def _stored(self, event: Stored) -> bool:
        changed = False
        if event.block_size != self.block_size:
            self._resize(event.block_size)
            changed = True
        size = self.block_size
        parent = None if event.parent is None else self._table.by_hash.get(event.parent)
        key = self._first(event) if event.parent is None else None
        if (event.parent is not None and parent is None) or (event.parent is None and key is None):
            self.unplaced += len(event.hashes)
            return changed
        tokens = event.tokens
        for m, h in enumerate(event.hashes):
            if m or key is None:
                assert parent is not None
                key = child_key(parent, tokens[m * size : (m + 1) * size])
            changed |= self._store(h, key, parent)
            parent = key
        assert parent is not None
        self._table.touch(parent)
        self._table.trim(self._claims)
        return changed

    def _first(self, event: Stored) -> int | None:
        """The key of a store's first block (no parent): from the one scope that runs
        registered with its tokens (or that the event's hints name); None when none or
        several."""
        tokens = event.tokens[: self.block_size]
        scopes = self._firsts.get(first_digest(tokens))
        if not scopes:
            return None
        if len(scopes) > 1:
            named = {s for s in scopes if s[0] in event.hints} or {
                s for s in scopes if s[1] in event.hints
            }
            if len(named) != 1:
                return None
            scopes = named
        return root_key(next(iter(scopes)), tokens)

    def _store(self, h: BlockHash, key: int, parent: int | None) -> bool:
        table = self._table
        was = table.by_hash.get(h)
        if was == key:
            return False
        changed = self._removed(h) if was is not None else False
        block = table.blocks.get(key) or table.new(key, parent)
        block.hashes.append(h)
        table.by_hash[h] = key
        if len(block.hashes) == 1 and table.parent_reachable(block):
            changed |= self._mark(block, reachable=True)
        return changed

    def _removed(self, h: BlockHash) -> bool:
        key = self._table.by_hash.pop(h, None)
        if key is None:
            return False
        block = self._table.blocks[key]
        block.hashes.remove(h)
        if not block.hashes and block.reachable:
            return self._mark(block, reachable=False)
        return False

    def _mark(self, block: _Block, reachable: bool) -> bool:
        """`block` and its descendants that change with it become `reachable` or not:
        reached, a stored descendant claims its edge blocks; unreached, a reachable
        one gives its claims up. Whether any claim changed."""
        blocks = self._table.blocks
        mark = self._claims.claim if reachable else self._claims.unclaim
        changed = False
        stack = [block]
        while stack:
            one = stack.pop()
            one.reachable = reachable
            changed |= mark(one.edge)
            for key in one.children or ():
                child = blocks.get(key)
                if (
                    child is not None
                    and child.reachable is not reachable
                    and (child.hashes or not reachable)
                ):
                    stack.append(child)
        return changed

    def _resize(self, block_size: int) -> None:
        """The server's blocks are another size: everything known is of the old one."""
        self.block_size = block_size
        self._table = _Table(self._table.max_blocks)
        self._firsts.clear()
        self._claims.reset()
