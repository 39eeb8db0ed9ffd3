"""The cache-aware policy (`[routing] policy = "cache_aware"`): the node whose KV cache
holds the longest prefix of the request, within a bound on load.

For each candidate (a healthy node with a free slot) the pool gives its
runs (`edge.fleet.load.runs`: what it reported, with this process's runs
counted from dispatch), its rank (`edge.fleet.load.rank`) and its cache
index (`edge.fleet.cacheindex`). Then:

1. **Load bound.** A node with more than `factor` x the candidates' mean
   runs + 1 (`[routing] cache_load_factor`, 2 by default) is not chosen for
   its cache.
2. **Share bound** (the hot-spot guard). A node whose share of this edge's
   recent dispatches (`Recent`: a count per node decayed by one step each
   dispatch, over about SHARE_WINDOW dispatches) is past `share_factor` x
   the candidates' mean + 1 is not chosen for its cache either. The load
   bound alone does not stop a hot prefix's node from taking most runs: its
   runs are hits, short, so it completes more of them with as many in
   flight. Past either bound the prefix's requests go to the next node in
   the prefix's order, which then holds it too, and so on: a hot prefix
   spreads over as many nodes as its traffic needs, and no more.
3. **Hit.** Of the nodes within both bounds, the one holding the longest
   prefix of the request's blocks (its expected prefill saved, in blocks of
   BLOCK_TOKENS tokens); between equal prefixes, the lower rank. Within the
   bounds the cache decides, because the prefill a hit saves grows with the
   prompt while the bounds keep the queue it may cost short.
4. **Miss** (no node within the bounds holds the first block): the node
   this edge last placed the prefix on (`Placements`, by its key block),
   if within the bounds and with room (below): a prefix's requests that
   arrive before its node reported storing it go where the first went (the
   exact index learns of a node's blocks only from its reports). Else
   rendezvous (highest-random-weight) hashing of the key block's hash over
   the candidates: the first node in that order within the bounds whose
   cache has room for the request's blocks beside its live demand (the
   blocks this edge sent it over about its last LIVE_WINDOW dispatches,
   `edge.fleet.cacheindex`: placed there, the prefix pushes out none still
   in use), or with no room anywhere the first within the bounds. A node
   whose live demand outgrew its cache (it was placed more prefixes than it
   holds) takes no new one, and a prefix placed there that it evicted
   goes to the next node in its order with room. Every edge sends a
   new prefix to the same node without talking to the others, so the next
   request of that prefix, from whichever edge, finds it there. With
   approximate indexes (no KV events: each edge's view is its own) it is
   the one of the first two with room whose index holds fewer blocks (two
   choices: hashing alone left one node 2 of 16 new prefixes and another
   6); every edge then sends a new prefix to one of the same two. With
   exact ones it is not: their counts move with each report, and two edges
   that compared them a moment apart placed a prefix apart (two edges hit
   0.85x of one). The key block (`key_block`) is the block at `threshold`
   of the request's blocks: two requests that share that much would be a
   hit on each other's node, so they are placed on the same one, and two
   that do not, apart. Keyed by the first block, new conversations that
   share a short system prompt, arriving before any node reported holding
   it, all had one key: each went where the first had, until its node was
   past the load bound (3 of 24 sessions on one node, 8 on another).
   (Balancing placements by this edge's own counts, bounded loads, placed
   prefixes more evenly but each edge differently: two edges then hit
   less; measured, BENCHMARKS.md. The live demand counts what an exact
   node reports storing as well, which every edge sees alike.)
5. **A weak prefix** (the longest prefix any node holds, past the bounds
   too, is under `threshold` of the request's blocks: `[routing]
   cache_threshold`, SMG's `cache_threshold`): a miss. New conversations
   that share only a short system prompt (or tool list) are placed by
   their key block, past what they share, over all the nodes; sent to the
   nodes holding the shared part, every new one would go to the nodes that
   held it first, and a node that did not would take none until the others
   were past the load bound.
6. A prompt shorter than one block: the least loaded (nothing to reuse).

Ties between equal ranks go round with `turn` (a number the pool advances
each pick), so that equal nodes share the runs evenly.

A session the client names (`session`: X-Session-Id, prompt_cache_key; not
a `user`, `edge.fleet.affinity.SessionKey` says why) pins the session to its
node as the affinity policy does, within the load bound; the request's
blocks are recorded there all the same.

`Choice.outcome` says which rule chose: `hit`, `miss`, `load_bound` (a node
past a bound held a longer prefix than the node chosen), `session`,
`short`; `predicted` is the chosen node's cached prefix in blocks, the
prediction each run's usage corrects (`CacheIndex.corrected`); `placed`, for
a miss that placed the prefix, the key block to remember it by (`Placements`).

Pure: no I/O, no clock (`Recent` counts dispatches, not time; so does the
live demand, by `tick`). Work per pick: one binary search per candidate,
O(nodes x log blocks) hash lookups, and on a new placement one rendezvous
score and at most one more binary search per candidate.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Final, Literal

from edge.fleet import affinity
from edge.fleet.cacheindex import CacheIndex
from edge.fleet.load import Rank

Outcome = Literal["hit", "miss", "load_bound", "session", "short"]
OUTCOMES: Final[tuple[Outcome, ...]] = ("hit", "miss", "load_bound", "session", "short")

# The share bound counts dispatches over about this many (`Recent`).
SHARE_WINDOW: Final = 64
# The prefixes that missed whose node this edge remembers.
MAX_PLACEMENTS: Final = 4096


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node that may take the run: its name, runs, rank and cache index."""

    name: str
    runs: int
    rank: Rank
    cache: CacheIndex
    # Its share of this edge's recent dispatches (`Recent`), decayed.
    share: float = 0.0


@dataclass(frozen=True, slots=True)
class Choice:
    """The candidate chosen (its index), why, its cached prefix in blocks, and for a
    placement (a miss), the key block's hash to remember the prefix's node by."""

    index: int
    outcome: Outcome
    predicted: int
    placed: int | None = None


class Route:
    """One request's routing state: its blocks, and what its last pick predicted (the
    chosen node's cached prefix in blocks, for the correction by the run's usage)."""

    __slots__ = ("blocks", "predicted")

    def __init__(self, blocks: array[int]) -> None:
        self.blocks = blocks
        self.predicted = 0


class Recent:
    """A count per node of recent events (dispatches, placements), each decayed by a
    factor 1 - 1/window per event: the events are the clock, so the counts are the
    nodes' shares of about the last `window` events. Decayed lazily, when read or
    added to: O(1) each, O(nodes) memory."""

    __slots__ = ("_counts", "_events", "decay")

    def __init__(self, window: int) -> None:
        self.decay = 1.0 - 1.0 / max(1, window)
        self._events = 0
        # Node -> (its count, the event it was last brought to).
        self._counts: dict[str, tuple[float, int]] = {}

    @property
    def events(self) -> int:
        """The events counted so far."""
        return self._events

    def __getitem__(self, name: str) -> float:
        count, at = self._counts.get(name, (0.0, 0))
        return count * self.decay ** (self._events - at) if count else 0.0

    def add(self, name: str) -> None:
        """One more event, on `name`."""
        count = self[name]
        self._events += 1
        self._counts[name] = (count * self.decay + 1.0, self._events)


class Placements:
    """Which node this edge last placed each prefix on (by its key block's hash), the
    most recent MAX_PLACEMENTS of them."""

    __slots__ = ("_where",)

    def __init__(self) -> None:
        self._where: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def get(self, key_block: int) -> str | None:
        return self._where.get(key_block)

    def placed(self, key_block: int, name: str) -> None:
        """A prefix placed on `name` (a miss)."""
        where = self._where
        where[key_block] = name
        where.move_to_end(key_block)
        if len(where) > MAX_PLACEMENTS:
            where.popitem(last=False)


def key_block(blocks: Sequence[int], threshold: float) -> int:
    """The block a miss of `blocks` (not empty) is placed by: the one at `threshold` of
    them, so that requests sharing enough of a prefix to be hits on one node are
    placed on the same node (the module doc, rule 4)."""
    return blocks[max(1, math.ceil(threshold * len(blocks))) - 1]


def rendezvous_key(block: int) -> str:
    """The rendezvous key of a prefix: its key block's hash, in hex."""
    return f"{block:016x}"


def within_bounds(nodes: Sequence[Candidate], factor: float, share_factor: float) -> list[bool]:
    """Whether each of `nodes` (not empty) is within the load bound (`factor` x their mean
    runs + 1) and the share bound (`share_factor` x their mean share + 1): a node that is
    not is not chosen for its cache (rules 1 and 2)."""
    count = len(nodes)
    bound = factor * sum(n.runs for n in nodes) / count + 1
    share_bound = share_factor * sum(n.share for n in nodes) / count + 1
    return [n.runs <= bound and n.share <= share_bound for n in nodes]


def choose(
    blocks: Sequence[int],
    nodes: Sequence[Candidate],
    *,
    session: str | None = None,
    factor: float,
    share_factor: float,
    threshold: float,
    placements: Placements | None = None,
    turn: int = 0,
    tick: int = 0,
) -> Choice:
    """The node of `nodes` (not empty) a request of `blocks` goes to (see the module doc):
    the bounds are `factor` x the mean runs + 1 and `share_factor` x the mean share + 1
    (`[routing] cache_load_factor`, `cache_share_factor`); a prefix held by no node past
    `threshold` of the blocks is weak (`cache_threshold`); `placements`: where this edge
    placed the prefixes that missed; `tick`: this edge's dispatches so far (the nodes'
    live demand)."""
    if not nodes:
        raise ValueError("no node to choose from")
    count = len(nodes)
    if session is not None:
        i = affinity.choose(session, [(n.name, n.runs) for n in nodes], factor=factor)
        return Choice(i, "session", nodes[i].cache.longest(blocks))
    if not blocks:
        return Choice(_lightest(nodes, range(count), turn), "short", 0)
    bound = factor * sum(n.runs for n in nodes) / count + 1
    within = within_bounds(nodes, factor, share_factor)
    held = [node.cache.longest(blocks) for node in nodes]
    reach = max(held)
    weak = reach < threshold * len(blocks)
    best, best_held, passed_over = -1, 0, 0
    best_key: tuple[Rank, int] | None = None
    if not weak:  # a weak prefix is a hit nowhere
        for i, node in enumerate(nodes):
            if not within[i]:
                passed_over = max(passed_over, held[i])
                continue
            if not held[i] or held[i] < best_held:
                continue
            key = (node.rank, (i - turn) % count)
            if held[i] > best_held or best_key is None or key < best_key:
                best, best_held, best_key = i, held[i], key
    if best >= 0:
        return Choice(best, "load_bound" if passed_over > best_held else "hit", best_held)
    outcome: Outcome = "load_bound" if passed_over else "miss"
    placed = key_block(blocks, threshold)
    placed_on = placements.get(placed) if placements is not None else None

    def place() -> int:
        if placed_on is not None:
            for i, node in enumerate(nodes):
                if node.name == placed_on and within[i] and node.cache.has_room(blocks, tick):
                    return i
        order = affinity.order(rendezvous_key(placed), [n.name for n in nodes])
        roomy = islice((i for i in order if within[i] and nodes[i].cache.has_room(blocks, tick)), 2)
        # The first with room; of two approximate indexes, the one holding less.
        first = next(roomy, None)
        if first is not None:
            second = next(roomy, None)
            if second is not None:
                one, two = nodes[first].cache, nodes[second].cache
                if not (one.exact or two.exact) and len(two) < len(one):
                    return second
            return first
        for i in order:
            if within[i]:
                return i
        # None within both (the lightest within the load bound, the lowest share within
        # the share bound, but two nodes): the lightest, the load bound before the share's.
        return _lightest(nodes, [i for i in range(count) if nodes[i].runs <= bound], turn)

    i = place()
    # Remembered (`Placements`) where the node held none of the prefix, or by a weak
    # prefix's key (the node may hold the shared part, not the rest).
    return Choice(i, outcome, held[i], placed if weak or not held[i] else None)


def _lightest(nodes: Sequence[Candidate], among: Sequence[int], turn: int) -> int:
    """The lowest rank of `among`; ties go round with `turn`."""
    best = min(nodes[i].rank for i in among)
    tied = [i for i in among if nodes[i].rank == best]
    return tied[turn % len(tied)]
