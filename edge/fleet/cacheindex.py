"""Which prefix blocks a node holds in its KV cache, as this edge knows it, and which
it must hold for the traffic this edge sends it: `CacheIndex`.

One index per node, keyed by the chained block hashes of requests'
prefix fingerprints (`edge.api.fingerprint`), fed from one of two sources:

- **approximate** (any node): the blocks of each request the edge routed
  to the node (`routed`), in an LRU of the node's capacity in blocks (its
  reported `kv_cache_tokens` // BLOCK_TOKENS; `[routing] cache_blocks`
  when it does not say), corrected by each run's usage: a node that says it
  had fewer cached input tokens than the index predicted (`corrected`) did
  not hold the blocks past that point, and they are dropped. A request's
  blocks are recorded deepest first, so the LRU evicts a prefix's tail
  before its head, as a paged KV cache does.
- **exact** (a node whose Watch reports carry KV block events): the node's
  own stores and evictions, and nothing else (`snapshot`, `reported`): a
  snapshot replaces the set, a report's stores then its evictions apply, the
  stores kept past the capacity by as many blocks as the report evicts (a
  full node stores by evicting; the capacity holds again once the evictions
  apply). Every edge watching the node then has the same view, with no
  gossip.

`longest` finds a request's longest cached prefix on the node by binary
search over its chain, O(log blocks) lookups: chained hashes mean that a
node holding block k normally holds blocks 0..k-1 too (it computed them
first, and the approximate index records and evicts a prefix tail first).
The search answers a boundary of what is held: block k-1 held and block k
not (or the chain's end), exact when the held blocks of the chain are a
prefix of it. An exact index may hold k without some earlier block (a node
that evicted a prefix's middle): the search then lands on one of the
boundaries, short of the first gap or past it. Either is a block the node
said it holds, and the error is the node's holes, not the index's; a node
that evicts leaves first (vLLM, SGLang, the simulated node) has none.

**Live demand** (either source; `LiveDemand`, which each index holds): the
blocks this edge sent the node over about its last LIVE_WINDOW dispatches (to
any node), each with the dispatch it was last sent with (`routed`'s `tick`),
and, with an exact index, the blocks the node reported storing over that time
(`reported`'s `tick`: the runs other edges sent it made it compute them, so edges
in front of the same nodes see each other's placements). `has_room` asks whether
those and a new request's blocks fit in the node's capacity: placed there, the
request would push out no block still in use. A cache's free blocks cannot say
it: a paged KV cache fills and stays full (an LRU evicts only to store), so once
warm every node looked full and a new prefix went by hashing alone, which left
one node 6 of 16 prefixes where it held 5, evicting them in turn for as long as
the traffic lasted (BENCHMARKS.md).

Bounded: an index holds at most its capacity in blocks, never more than
MAX_BLOCKS (whatever a node reports; blocks an exact node says it stored
past that are not kept), and its live demand at most its capacity and
MAX_PREFIX_BLOCKS more (enough to tell that a request does not fit). Memory:
~130 bytes a block held (an OrderedDict entry and its int; measured), twice
over with the live demand, so 16,384 blocks (the default capacity, 1M
tokens) is ~4.5 MiB per node, and MAX_BLOCKS ~260 MiB.

Pure: hashes in, counts out; no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

from edge.contract.prefix import MAX_PREFIX_BLOCKS

# The most blocks one node's index holds, whatever the node reports (64M tokens).
MAX_BLOCKS = 1 << 20
# A block sent to a node counts in its live demand for this many dispatches after
# (this edge's, to any node; measured: 32 and 128 hit less, BENCHMARKS.md).
LIVE_WINDOW = 64


def longest_held(held: Container[int], blocks: Sequence[int]) -> int:
    """How many of `blocks` (a chain, block 0 first) `held` holds as a prefix: the
    largest k with block k-1 held, found by binary search (see the module doc)."""
    if not blocks or blocks[0] not in held:
        return 0
    low, high = 1, len(blocks)  # blocks[low - 1] is held; past `high`, nothing
    while low < high:
        middle = (low + high + 1) // 2
        if blocks[middle - 1] in held:
            low = middle
        else:
            high = middle - 1
    return low


class LiveDemand:
    """The blocks this edge sent one node over about its last LIVE_WINDOW dispatches, each
    with the dispatch it was last sent with (the module doc's live demand). The node's
    capacity comes with each call: its index keeps it."""

    __slots__ = ("_ticks",)

    def __init__(self) -> None:
        # Hash -> the dispatch it was last sent with, oldest first.
        self._ticks: OrderedDict[int, int] = OrderedDict()

    def sent(self, blocks: Iterable[int], tick: int, capacity: int) -> None:
        """These blocks were sent to the node (or stored by it) at dispatch `tick`."""
        ticks = self._ticks
        to_end = ticks.move_to_end
        for block in blocks:
            ticks[block] = tick
            to_end(block)
        self.trim(capacity)

    def trim(self, capacity: int) -> None:
        """At most `capacity` and MAX_PREFIX_BLOCKS more kept, the oldest dropped first."""
        ticks = self._ticks
        while len(ticks) > capacity + MAX_PREFIX_BLOCKS:
            ticks.popitem(last=False)

    def has_room(self, blocks: Sequence[int], tick: int, capacity: int) -> bool:
        """Whether the demand at dispatch `tick` and those of `blocks` not in it fit in
        `capacity` blocks."""
        ticks = self._ticks
        self._expire(tick)
        new = len(blocks) - longest_held(ticks, blocks)
        return len(ticks) + new <= capacity

    def count(self, tick: int) -> int:
        """The demand at dispatch `tick`, in blocks."""
        self._expire(tick)
        return len(self._ticks)

    def _expire(self, tick: int) -> None:
        """Blocks last sent LIVE_WINDOW dispatches or more before `tick` leave the live
        demand (the oldest are first: one step each, each once)."""
        ticks = self._ticks
        oldest = tick - LIVE_WINDOW
        while ticks:
            block = next(iter(ticks))
            if ticks[block] > oldest:
                return
            del ticks[block]


class CacheIndex:
    """The prefix blocks one node holds, approximate (from routing) or exact (from the
    node's own KV events), and its live demand."""

    __slots__ = ("_blocks", "_live", "capacity", "exact")

    def __init__(self, capacity: int) -> None:
        # Hash -> None, least recently used first (an exact index keeps no order).
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._live = LiveDemand()
        self.capacity = max(1, min(capacity, MAX_BLOCKS))
        # Fed by the node's KV events (its Watch reports): routing and usage change nothing.
        self.exact = False

    def __len__(self) -> int:
        return len(self._blocks)

    def has_room(self, blocks: Sequence[int], tick: int) -> bool:
        """Whether the node's live demand at dispatch `tick` and those of `blocks` not in
        it fit in its capacity (the module doc)."""
        return self._live.has_room(blocks, tick, self.capacity)

    def live(self, tick: int) -> int:
        """The node's live demand at dispatch `tick`, in blocks."""
        return self._live.count(tick)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def resize(self, capacity: int) -> None:
        """The node's capacity in blocks changed (its report): at most that many kept."""
        self.capacity = max(1, min(capacity, MAX_BLOCKS))
        self._trim()
        self._live.trim(self.capacity)

    def longest(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` (a chain, block 0 first) the node holds as a prefix."""
        return longest_held(self._blocks, blocks)

    # --- approximate: routing, corrected by usage -----------------------------------------

    def routed(self, blocks: Sequence[int], tick: int) -> None:
        """A request of these blocks was sent to the node, with this edge's dispatch
        `tick`: they count in its live demand, and it will hold them. Recorded deepest
        first, so block 0 is the most recently used (an exact index: the live demand
        only)."""
        self._live.sent(reversed(blocks), tick, self.capacity)
        if self.exact:
            return
        held = self._blocks
        move = held.move_to_end
        for block in reversed(blocks):
            if block in held:
                move(block)
            else:
                held[block] = None  # a new key goes last
        self._trim()

    def corrected(self, blocks: Sequence[int], predicted: int, cached: int) -> None:
        """A run of `blocks` for which the index predicted `predicted` cached blocks found
        `cached` (its usage's cached input tokens, in blocks): when fewer, the blocks
        from `cached` on were not held, whatever routing said; they are dropped."""
        if self.exact or cached >= predicted:
            return
        held = self._blocks
        for block in blocks[max(0, cached) :]:
            held.pop(block, None)

    # --- exact: the node's KV events ------------------------------------------------------

    def snapshot(self, blocks: Sequence[int]) -> None:
        """The node holds these blocks, and no others: the index becomes exact."""
        self.exact = True
        self._blocks.clear()
        self.reported(blocks, ())

    def reported(
        self, stored: Sequence[int], evicted: Sequence[int], tick: int | None = None
    ) -> None:
        """One report of the node's: the blocks it stored, then those it evicted; with
        `tick`, the stored ones count in its live demand from that dispatch on. A full
        node stores by evicting, so the stores are kept past the capacity by as many
        blocks as the report evicts; once the evictions apply, at most the capacity is
        kept (a node is not trusted)."""
        if tick is not None:
            self._live.sent(stored, tick, self.capacity)
        held = self._blocks
        room = self.capacity + len(evicted) - len(held)
        for block in stored:
            if block in held:
                continue
            if room <= 0:
                break
            held[block] = None
            room -= 1
        for block in evicted:
            held.pop(block, None)
        self._trim()

    def clear(self) -> None:
        """Forget what the node holds, and be approximate again (the node stopped
        reporting, or restarted). The live demand stays: it is this edge's traffic."""
        self._blocks.clear()
        self.exact = False

    def _trim(self) -> None:
        held = self._blocks
        while len(held) > self.capacity:
            held.popitem(last=False)
