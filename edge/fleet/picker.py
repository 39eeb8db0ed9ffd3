"""Which of the nodes that may take a run gets it, by the routing policy: `Picker`.

The pool (`edge.fleet.pool`) hands it the nodes that could take the run
(serving the model, healthy, not excluded); the picker chooses among those
with a free slot (`in_flight < max_runs`, the edge's own bound whatever the
node reports):
- least loaded (`[routing] policy = "least_loaded"`): by `edge.fleet.load.rank`,
  the node's own load where it reports it, else this process's runs on it;
  ties go round (a turn advanced each pick), so equal nodes share the runs;
- the session's node under the affinity policy (`edge.fleet.affinity`);
- the node holding the longest prefix of the request under the cache-aware
  policy (`edge.fleet.cacheaware`: each node's `CacheIndex`, fed by the
  blocks routed there, corrected by each run's usage, or by the node's own
  KV events on its Watch reports). The node chosen is recorded as holding
  the request's blocks, in its live demand and the edge's recent dispatches
  (the share bound), and the prefix's placement when it was a miss.

A node whose reported queue is longer than that of a node only full here is
not picked: the run waits at the edge for the other's slot (None) rather
than join the queue.

Knows nothing of models, health or the edge's errors: those are the pool's.
"""

from __future__ import annotations

from collections.abc import Callable

from edge.config import RoutingConfig
from edge.contract.prefix import BLOCK_TOKENS
from edge.fleet import affinity, cacheaware, load
from edge.fleet.affinity import SessionKey
from edge.fleet.cacheaware import Candidate, Route
from edge.fleet.nodestate import NodeState


def _queued_behind(chosen: NodeState, healthy: list[NodeState]) -> bool:
    """Whether `chosen` has runs waiting in its queue (as it reports it) while a node with
    fewer is only full here (no slot of this process's): the run is better off waiting
    at the edge for that node's slot than behind the queue, where no edge can take it
    back. Without reports, nobody's queue is known: never."""
    queue = chosen.rank()[0]
    return queue > 0 and any(s.rank()[0] < queue for s in healthy if not s.has_slot())


class Picker:
    """The choice of a node among those that could take a run (see the module doc), and
    what cache-aware routing remembers of its choices."""

    def __init__(self, routing: RoutingConfig) -> None:
        # cache_aware: each node's recent dispatches (the share bound) and where this
        # edge placed each prefix that missed (edge.fleet.cacheaware).
        self.shares = cacheaware.Recent(cacheaware.SHARE_WINDOW)
        self.placements = cacheaware.Placements()
        # Advanced each pick: ties between equal nodes start from the next one.
        self._turn = 0
        # Hears each cache-aware pick: (outcome, node, predicted cached tokens).
        self.on_routed: Callable[[cacheaware.Outcome, str, int], None] | None = None
        self.configure(routing)

    def configure(self, routing: RoutingConfig) -> None:
        """The policy and its knobs (at start, and a reload's `[routing]`)."""
        self.affinity = routing.policy == "affinity"
        self.cache_aware = routing.policy == "cache_aware"
        self.cache_blocks = routing.cache_blocks
        self.cache_load_factor = routing.cache_load_factor
        self.cache_share_factor = routing.cache_share_factor
        self.cache_threshold = routing.cache_threshold
        self.cache_hold_s = routing.cache_hold_s

    @property
    def dispatches(self) -> int:
        """The runs this edge routed by cache so far (the clock of the nodes' live demand)."""
        return self.shares.events

    def choose(
        self, healthy: list[NodeState], affinity_key: SessionKey | None, route: Route | None
    ) -> NodeState | None:
        """A node of `healthy` with a free slot for a new run, or None when none has one
        or the run had better wait at the edge (the module doc). Under the cache-aware
        policy, `route` is the request's prefix blocks: the node chosen is recorded as
        holding them, and `route.predicted` set to its cached prefix."""
        free = [s for s in healthy if s.has_slot()]
        if not free:
            return None
        turn = self._turn  # the first pick's ties go to the first listed, then round
        self._turn = turn + 1
        if self.cache_aware and route is not None:
            choice = self._cached(free, affinity_key, route, turn)
            chosen = free[choice.index]
        else:
            choice, chosen = None, self._least_loaded(free, affinity_key, turn)
        if len(free) < len(healthy) and _queued_behind(chosen, healthy):
            return None  # wait here for a place on a node without that queue
        if choice is not None and route is not None:
            self._routed(chosen, route, choice)
        return chosen

    def _least_loaded(
        self, free: list[NodeState], affinity_key: SessionKey | None, turn: int
    ) -> NodeState:
        if self.affinity and affinity_key is not None and len(free) > 1:
            loads = [(s.client.name, load.runs(s.load, s.in_flight, s.at_report)) for s in free]
            return free[affinity.choose(affinity_key.key, loads)]
        if len(free) == 1:
            return free[0]
        # Ties go round (the turn advances each pick): equal nodes share the runs evenly.
        ranks = load.comparable([s.rank() for s in free])
        best_rank = min(ranks)
        tied = [s for s, rank in zip(free, ranks, strict=True) if rank == best_rank]
        return tied[turn % len(tied)]

    def _cached(
        self, free: list[NodeState], affinity_key: SessionKey | None, route: Route, turn: int
    ) -> cacheaware.Choice:
        # Only a session the client named is pinned (`SessionKey` says why).
        session = affinity_key.key if affinity_key is not None and affinity_key.named else None
        return cacheaware.choose(
            route.blocks, self._candidates(free), session=session, factor=self.cache_load_factor,
            share_factor=self.cache_share_factor, threshold=self.cache_threshold,
            placements=self.placements, turn=turn, tick=self.dispatches,
        )  # fmt: skip

    def within_bounds(self, nodes: list[NodeState]) -> list[bool]:
        """Whether each of `nodes` (not empty) is within the cache-aware policy's load and
        share bounds among them (`cacheaware.within_bounds`): one that is not is neither
        chosen for its cache nor waited for (`edge.fleet.cachehold`)."""
        return cacheaware.within_bounds(
            self._candidates(nodes), self.cache_load_factor, self.cache_share_factor
        )

    def _candidates(self, nodes: list[NodeState]) -> list[Candidate]:
        ranks = load.comparable([s.rank() for s in nodes])
        return [
            Candidate(
                s.client.name,
                load.runs(s.load, s.in_flight, s.at_report),
                rank,
                s.cache,
                share=self.shares[s.client.name],
            )
            for s, rank in zip(nodes, ranks, strict=True)
        ]

    def _routed(self, chosen: NodeState, route: Route, choice: cacheaware.Choice) -> None:
        """The run of `route` goes to `chosen`: its blocks recorded there, in its live
        demand and (approximate) its index (dict steps a block, on the loop: 0.6 ms for
        MAX_PREFIX_BLOCKS with an exact index, 1.3 ms with an approximate one; measured)."""
        route.predicted = choice.predicted
        name = chosen.client.name
        self.shares.add(name)
        chosen.cache.routed(route.blocks, self.dispatches)
        if choice.placed is not None:  # a prefix placed there
            self.placements.placed(choice.placed, name)
        if self.on_routed is not None:
            self.on_routed(choice.outcome, chosen.client.name, choice.predicted * BLOCK_TOKENS)
