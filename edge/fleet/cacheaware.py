"""The cache-aware policy (`[routing] policy = "cache_aware"`): the node whose KV cache
holds the longest prefix of the request, within a bound on load.

For each candidate (a healthy node with a free slot) the pool gives its
runs (`edge.fleet.load.runs`: what it reported, with this process's runs
counted from dispatch), its rank (`edge.fleet.load.rank`) and its cache
index (`edge.fleet.cacheindex`). Then:

1. **Load bound.** A node with more than `factor` x the candidates' mean
   runs + 1 (1.25 x mean + 1 by default, as the affinity policy) is not
   chosen for its cache: the bound is the hot-spot guard. However popular
   a prefix, its node takes runs only up to the bound; past it the prefix's
   requests go to the next node in the prefix's order, which then holds
   it too, and so on: a hot prefix spreads over as many nodes as its load
   needs, and no more.
2. **Hit.** Of the nodes within the bound, the one holding the longest
   prefix of the request's blocks (its expected prefill saved, in blocks of
   BLOCK_TOKENS tokens); between equal prefixes, the lower rank. Within the
   bound the cache decides, because the prefill a hit saves grows with the
   prompt while the bound keeps the queue it may cost short.
3. **Miss** (no node within the bound holds the first block): rendezvous
   (highest-random-weight) hashing of the first block's hash over the
   candidates, with the same bound (`edge.fleet.affinity.choose`): every
   edge sends a new prefix to the same node, without talking to the others,
   so the next request of that prefix, from whichever edge, finds it there.
4. A prompt shorter than one block: the least loaded (nothing to reuse).

A session key (`X-Session-Id`, else `user`) pins the session to its node
as the affinity policy does, within the same bound; the request's blocks
are recorded there all the same.

`Choice.outcome` says which rule chose: `hit`, `miss`, `load_bound` (a node
past the bound held a longer prefix than the node chosen), `session`,
`short`; `predicted` is the chosen node's cached prefix in blocks, the
prediction each run's usage corrects (`CacheIndex.corrected`).

Pure: no I/O, no clock. Work per pick: one binary search per candidate,
O(nodes x log blocks) hash lookups, and one rendezvous score per candidate
on a miss.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from edge.fleet import affinity
from edge.fleet.cacheindex import CacheIndex
from edge.fleet.load import Rank

Outcome = Literal["hit", "miss", "load_bound", "session", "short"]
OUTCOMES: Final[tuple[Outcome, ...]] = ("hit", "miss", "load_bound", "session", "short")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node that may take the run: its name, runs, rank and cache index."""

    name: str
    runs: int
    rank: Rank
    cache: CacheIndex


@dataclass(frozen=True, slots=True)
class Choice:
    """The candidate chosen (its index), why, and its cached prefix in blocks."""

    index: int
    outcome: Outcome
    predicted: int


class Route:
    """One request's routing state: its blocks, and what its last pick predicted (the
    chosen node's cached prefix in blocks, for the correction by the run's usage)."""

    __slots__ = ("blocks", "predicted")

    def __init__(self, blocks: array[int]) -> None:
        self.blocks = blocks
        self.predicted = 0


def rendezvous_key(first_block: int) -> str:
    """The rendezvous key of a prefix: its first block's hash, in hex."""
    return f"{first_block:016x}"


def choose(
    blocks: Sequence[int],
    nodes: Sequence[Candidate],
    *,
    session: str | None = None,
    factor: float = affinity.LOAD_FACTOR,
) -> Choice:
    """The node of `nodes` (not empty) a request of `blocks` goes to (see the module doc)."""
    if not nodes:
        raise ValueError("no node to choose from")
    if session is not None:
        i = affinity.choose(session, [(n.name, n.runs) for n in nodes], factor=factor)
        return Choice(i, "session", nodes[i].cache.longest(blocks))
    if not blocks:
        best = min(range(len(nodes)), key=lambda i: (nodes[i].rank, i))
        return Choice(best, "short", 0)
    bound = factor * sum(n.runs for n in nodes) / len(nodes) + 1
    best, best_held, passed_over = -1, 0, 0
    best_rank: Rank | None = None
    for i, node in enumerate(nodes):
        held = node.cache.longest(blocks)
        if node.runs > bound:
            passed_over = max(passed_over, held)
            continue
        if held > best_held or (
            held and held == best_held and best_rank is not None and node.rank < best_rank
        ):
            best, best_held, best_rank = i, held, node.rank
    if best >= 0:
        return Choice(best, "load_bound" if passed_over > best_held else "hit", best_held)
    loads = [(n.name, n.runs) for n in nodes]
    i = affinity.choose(rendezvous_key(blocks[0]), loads, factor=factor)
    return Choice(i, "load_bound" if passed_over else "miss", nodes[i].cache.longest(blocks))
