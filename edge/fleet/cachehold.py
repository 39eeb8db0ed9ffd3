"""The cache hold: a request queued for a node slot passes up a free one, for a bounded
time, to wait for a busy node that holds much more of its prompt (`[routing]
cache_hold_s`, cache_aware): `better_node` (the rule, pure) and `Holds` (each
waiter's hold in the admission queue).

Why: when the edge holds the queue (nodes capped by `[[nodes]] max_runs` or by
their own Describe `max_runs`) and every slot is busy, a slot freed goes to the
first waiter that can use it (`edge.fleet.admission`), and the cache-aware pick
(`edge.fleet.cacheaware`) only chooses among the nodes with a free slot: the
head of the queue takes the node that freed first, whatever it holds. Once the
fleet is full, that is most requests: routing by cache becomes routing by load
(the cache-pressure benchmark cached 0.57 of the prompt tokens so, against 0.92
with the nodes queueing their own runs).

The rule (`better_node`): offered a free slot, a queued request of `blocks`
passes it up for a node without a free slot (one its pick would consider once it
has one: serving its model, healthy, not excluded) that
- holds at least `threshold` of its blocks more than any node with a free slot
  (`[routing] cache_threshold`, at least one block): the prefill that waiting
  saves is a real share of its prompt, as a prefix is worth routing for only past
  that share (SMG's `cache_threshold`). The node this edge last placed the
  prefix on as a miss (`cacheaware.Placements`) holds it up to its key block:
  its run is still prefilling it, and an exact index learns of it only from the
  node's report;
- is within the cache-aware bounds on load and share (`cacheaware.within_bounds`):
  a node that would not be chosen for its cache is not waited for either, so a
  hot prefix still spreads to the next node;
- is expected to free a slot for it within the hold it has left: the node's time
  between slots freed while it was full (`NodeState.free_every`, smoothed over
  the slots it gave back full: `slot_freed`), once for each request already
  waiting for it ahead of this one and once for this one (a node with no such
  time yet: as many waiting as it has slots). As llm-d's prefix-affinity gate
  stops keeping a request on its prefix's pod past a predicted TTFT penalty, a
  node too busy to serve it within its hold is not waited for.
Of such nodes, the one holding the most blocks, then the soonest expected.

The bound: a request passes up slots for at most `cache_hold_s` from the first
one it passed up (`hold_until`, fixed then: a reload changes the holds that start
after it); then it takes its turn as any other. It waits with a slot free for it
for at most that bound in all, the rest of its wait being its queue time with
every slot busy, as without the hold: while it holds it keeps its place in
the queue (the queue sets aside a request that cannot run yet with its turn, and
so one that holds: `edge.fleet.queues`), a request behind it that fits the free
node better (or has no cached prefix anywhere) takes the slot, and a slot none of
them takes stays free only while each of them holds. When a hold ends with such
a slot still free, the waiter's own task offers the free slots again (`wait`),
so a slot is idle no longer than the holds of the requests that passed it up.

Not held: a retry or a moved answer (they waited their turn already), a request
under another policy or without prefix blocks, and, before it joins the queue,
a new request the queue would shed someone for (a free slot is not traded for a
shed). Nodes without a cap (the nodes queue their own runs) always have a slot:
nothing to pass up.

Work: a request offered a slot costs one look-up of its prefix per node and the
bounds over the nodes (as a cache-aware pick does), and only while some node has a
slot and some has none; a dispatch looks at no more requests than before
(`edge.fleet.queues.SCAN`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import trio

from edge.fleet import cacheaware
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool, sort_nodes
from edge.fleet.queues import Waiter

# How far one slot given back by a full node moves its time between slots freed.
_SMOOTHING = 0.2

# How a request's hold ended: a slot handed to it while it held, its bound passed
# first, or it left the queue (its client gone, its queue timeout, shed).
HOLD_OUTCOMES = ("served", "expired", "left")


def slot_freed(node: NodeState, now: float) -> None:
    """`node` gives back a slot at `now` (before its count drops): when it was full, the
    time since the last slot it gave back full moves its `free_every`."""
    if node.in_flight < node.max_runs:
        node.freed_at = None  # not full: the next slot freed full starts a new interval
        return
    if node.freed_at is not None:
        gap = now - node.freed_at
        every = node.free_every
        node.free_every = gap if not every else every + _SMOOTHING * (gap - every)
    node.freed_at = now


def better_node(
    blocks: Sequence[int],
    nodes: Sequence[NodeState],
    *,
    threshold: float,
    left_s: float,
    waiting: Mapping[NodeState, int],
    placed: str | None = None,
    within: Sequence[bool] | None = None,
) -> NodeState | None:
    """The busy node of `nodes` a request of `blocks`, with `left_s` of its hold left,
    waits for rather than take a free slot (the module doc), or None. `waiting`: the
    requests already waiting for each node ahead of it; `placed`: the node this edge
    last placed the prefix on, a miss (`cacheaware.Placements`), which holds it up to
    its key block as soon as its run's prefill is done, before its index may say so;
    `within`: whether each node is within the cache-aware bounds on load and share (one
    that is not is not waited for; None: all are)."""
    free = [s for s in nodes if s.has_slot()]
    if not free or len(free) == len(nodes) or not blocks:
        return None  # nothing to pass up, or nothing to wait for
    gap = max(1, math.ceil(threshold * len(blocks)))
    need = max((s.cache.longest(blocks) for s in free), default=0) + gap
    best: tuple[int, float] | None = None
    chosen = None
    for i, state in enumerate(nodes):
        if state.has_slot() or (within is not None and not within[i]):
            continue
        held = state.cache.longest(blocks)
        if placed is not None and state.client.name == placed:
            held = max(held, gap)
        if held < need:
            continue
        ahead = waiting.get(state, 0)
        if state.free_every:
            expected = state.free_every * (ahead + 1)
            if expected > left_s:
                continue
        elif ahead >= state.max_runs:
            continue
        else:
            expected = 0.0
        if best is None or (held, -expected) > best:
            best, chosen = (held, -expected), state
    return chosen


class Holds:
    """The holds of the requests in one admission queue (the module doc): whether a
    waiter passes up a slot (`passes`), its wait with its hold's end (`wait`), and how
    each hold ended (`ended`, told to `on_end` with the hold's length in seconds)."""

    def __init__(self, pool: NodePool, on_end: Callable[[str, float], None]) -> None:
        self._pool = pool
        self._on_end = on_end
        # The requests holding now, by the node each waits for (the new ones' `waiting`).
        self._waiting: dict[NodeState, int] = {}

    def passes(self, waiter: Waiter, waiting: dict[NodeState, int] | None = None) -> bool:
        """Whether `waiter`, offered a free slot now, passes it up (its hold starts with
        the first). `waiting`: the requests ahead of it that pass up this slot, by the
        node they wait for (a dispatch's, counted here); None: those holding now (a new
        request, behind all of them)."""
        picker = self._pool.picker
        route = waiter.route
        if waiter.hold_over or route is None or not picker.cache_aware:
            return False
        now = trio.current_time()
        hold_s = picker.cache_hold_s
        left = hold_s if waiter.hold_until is None else waiter.hold_until - now
        if left <= 0:
            return False
        nodes = sort_nodes(
            self._pool.nodes, waiter.model, logprobs=waiter.logprobs, exclude=waiter.exclude,
            now=now,
        ).healthy  # fmt: skip
        free = sum(1 for s in nodes if s.has_slot())
        node = None
        if route.blocks and 0 < free < len(nodes):  # a slot to pass up, a node to wait for
            threshold = picker.cache_threshold
            node = better_node(
                route.blocks, nodes, threshold=threshold, left_s=left,
                waiting=self._waiting if waiting is None else waiting,
                placed=picker.placements.get(cacheaware.key_block(route.blocks, threshold)),
                within=picker.within_bounds(nodes),
            )  # fmt: skip
        self._holding(waiter, node)
        if node is None:
            return False
        if waiting is not None:
            waiting[node] = waiting.get(node, 0) + 1
        if waiter.hold_until is None:
            waiter.held_at = now
            waiter.hold_until = now + hold_s
            if waiter.scope is not None:
                waiter.scope.deadline = waiter.hold_until
        return True

    def ended(self, waiter: Waiter, outcome: str) -> None:
        """`waiter` holds no more: it was handed a slot (`served`), its bound passed
        (`expired`) or it left the queue (`left`); counted once, if it held at all."""
        if waiter.hold_over:
            return
        waiter.hold_over = True
        self._holding(waiter, None)
        if waiter.held_at is not None:
            self._on_end(outcome, trio.current_time() - waiter.held_at)

    async def wait(self, waiter: Waiter, dispatch: Callable[[], None]) -> None:
        """Until `waiter` is handed a slot (or an error). When its hold ends first, it
        holds no more and the free slots are offered again (`dispatch`): a slot it passed
        up is idle no longer than its hold."""
        while not waiter.woken.is_set():
            until = None if waiter.hold_over else waiter.hold_until
            with trio.CancelScope(deadline=math.inf if until is None else until) as scope:
                waiter.scope = scope
                await waiter.woken.wait()
            waiter.scope = None
            if not waiter.woken.is_set():
                self.ended(waiter, "expired")
                dispatch()

    def _holding(self, waiter: Waiter, node: NodeState | None) -> None:
        """`waiter` waits for `node` now (None: for no node in particular)."""
        old = waiter.holding
        if old is node:
            return
        counts = self._waiting
        if old is not None:
            left = counts[old] - 1
            if left:
                counts[old] = left
            else:
                del counts[old]
        if node is not None:
            counts[node] = counts.get(node, 0) + 1
        waiter.holding = node
