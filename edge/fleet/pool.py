"""The nodes an edge routes to: their models, health, slots, and the pick of one per run.
(One node's state is `edge.fleet.nodestate.NodeState`.)

What each node serves and how it is (models, max_runs, load, health) is kept
by the feed (`edge.fleet.feed`: each node's Watch stream, or its Describe
answers, in one background task). Nothing of it runs per request: `pick`
only reads the states, and the run side reports each run's verdict
(`run_succeeded`, `run_failed`) and refusals (`mark_down`, which also ends a
watched node's subscription: it is subscribed to again as a down node is
probed). What the edge shows of the nodes (`/readyz`, the gauges) is
`edge.fleet.readiness`.

`pick` chooses a node for a new run: one serving the model, healthy (up,
its breaker closed or half-open with the probe run free), not excluded
(the nodes a failing-over run already tried), with a free slot
(`in_flight < max_runs`, the edge's own bound whatever the node reports);
least loaded (`edge.fleet.load.rank`: by the node's own load where it
reports it, else by this process's runs on it), or the session's node under
the affinity policy (`edge.fleet.affinity`), or the node holding the
longest prefix of the request under the cache-aware policy
(`edge.fleet.cacheaware`: each node's `CacheIndex`, fed by the blocks routed
there, corrected by each run's usage (`run_usage`), or by the node's own KV
events on its Watch reports). A node whose reported queue is
longer than that of a node only full here is not picked: the run waits at
the edge for the other's slot (`pick` answers None) rather than join the
queue. When every node serving the model
(and not excluded) is marked down, panic routing tries one anyway, the one
that failed least recently: a down mark may be stale, and answering 503
outright would turn a blip into an outage. An open breaker is not stale: a
node behind one gets no run, panic or not. `pick` raises the edge's errors:
NotFoundError for a model no node serves, NodeUnavailableError when the
nodes that could serve it are excluded, down or behind an open breaker and
none is left to try.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

import trio
from loguru import logger

from edge.config import RoutingConfig
from edge.contract.prefix import BLOCK_TOKENS
from edge.errors import NodeUnavailableError, NotFoundError, RequestError
from edge.fleet import affinity, cacheaware, load
from edge.fleet.affinity import SessionKey
from edge.fleet.cacheaware import Candidate, Route
from edge.fleet.feed import NodeFeed
from edge.fleet.health import HealthPolicy, NodeHealth, NodeStateName
from edge.fleet.nodestate import NodeState, max_runs_of
from edge.node.client import NodeClient
from edge.observe.logbound import clip
from edge.stream.events import Usage

REFRESH_INTERVAL_S = 5.0


# Run failures the breaker counts: the node's error before output, a start it
# failed, an accept that never came, a stream that broke. Not "timeout" (the
# edge's own deadline on a long or slow answer: an overloaded machine times out
# on every node alike, and opening breakers then only moves the load until all
# are open) nor "unavailable" (a refused start marks the node down instead).


def _queued_behind(chosen: NodeState, healthy: list[NodeState]) -> bool:
    """Whether `chosen` has runs waiting in its queue (as it reports it) while a node with
    fewer is only full here (no slot of this process's): the run is better off waiting
    at the edge for that node's slot than behind the queue, where no edge can take it
    back. Without reports, nobody's queue is known: never."""
    queue = chosen.rank()[0]
    return queue > 0 and any(s.rank()[0] < queue for s in healthy if not s.has_slot())


class NodePool:
    """The edge's nodes: health kept in one background task, a node picked per run.

    `on_available` (set by the admission queue) is called when a node may take
    runs it could not before: it came up, its breaker half-opened or closed,
    its max_runs rose. A slot given back is the run side's to announce.
    """

    def __init__(
        self,
        clients: list[NodeClient],
        *,
        routing: RoutingConfig | None = None,
        max_runs: Mapping[str, int] | None = None,
        refresh_s: float = REFRESH_INTERVAL_S,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.policy = HealthPolicy(refresh_s=refresh_s)
        self._set_routing(routing if routing is not None else RoutingConfig())
        # cache_aware: each node's recent dispatches (the share bound) and where this
        # edge placed each prefix that missed (edge.fleet.cacheaware).
        self.shares = cacheaware.Recent(cacheaware.SHARE_WINDOW)
        self.placements = cacheaware.Placements()
        # Advanced each pick: ties between equal nodes start from the next one.
        self._turn = 0
        caps = max_runs or {}
        self.nodes = [self._state(c, caps.get(c.name)) for c in clients]
        self.on_available: Callable[[], None] | None = None
        # Hears each cache-aware pick: (outcome, node, predicted cached tokens).
        self.on_routed: Callable[[cacheaware.Outcome, str, int], None] | None = None
        self._clock = clock
        self.feed = NodeFeed(self, clock)

    def _set_routing(self, routing: RoutingConfig) -> None:
        """The policy and its knobs, the breaker's numbers and the Watch heartbeat."""
        self.policy = replace(
            self.policy,
            breaker_failures=routing.breaker_failures,
            cooldown_s=routing.breaker_cooldown_s,
        )
        self.affinity = routing.policy == "affinity"
        self.cache_aware = routing.policy == "cache_aware"
        self.cache_blocks = routing.cache_blocks
        self.cache_load_factor = routing.cache_load_factor
        self.cache_share_factor = routing.cache_share_factor
        self.cache_threshold = routing.cache_threshold
        self.watch_heartbeat_s = routing.watch_heartbeat_s

    def _state(self, client: NodeClient, max_runs: int | None) -> NodeState:
        blocks = self.cache_blocks if self.cache_aware else 1
        return NodeState(client, NodeHealth(self.policy), max_runs=max_runs, cache_blocks=blocks)

    # --- what a reload changes ------------------------------------------------------------

    def configure(self, routing: RoutingConfig, refresh_s: float) -> None:
        """A reload's `[routing]` and `[server] node_refresh_s`, from the next pick and
        the next check of each node on (a node's breaker and probes keep their state; a
        new subscription asks for the new heartbeat). Switched to cache_aware, a node's
        index that only ever held one block is sized as a node without a reported
        capacity is."""
        self.policy = replace(self.policy, refresh_s=refresh_s)
        self._set_routing(routing)
        for state in self.nodes:
            state.health.policy = self.policy
            if self.cache_aware and not state.cache.exact and state.cache.capacity == 1:
                state.cache.resize(self.cache_blocks)
        self.feed.wake()

    def add(self, client: NodeClient, max_runs: int | None = None) -> NodeState:
        """A node that joined the configuration. It takes no run before it answered: until
        its first Watch report (or Describe) it serves no model (the background task
        subscribes to it at once; `NodeState.probed` is set once it answered, or failed
        to)."""
        state = self._state(client, max_runs)
        self.nodes = [*self.nodes, state]
        self.feed.wake()
        return state

    def set_max_runs(self, state: NodeState, max_runs: int | None) -> None:
        """A reload's `max_runs` of a node that stays: its cap from now on (the runs it
        has keep their slots)."""
        state.configured_max_runs = max_runs
        old = state.max_runs
        state.max_runs = max_runs_of(max_runs, state.description)
        if state.max_runs > old:
            self.available()

    def remove(self, state: NodeState) -> None:
        """A node that left the configuration: no new run from now on (not even a queued
        request's), its subscription ends; the runs it has finish (the caller closes its
        connection once they have: `edge.process.nodeset`)."""
        self.nodes = [s for s in self.nodes if s is not state]
        state.retired = True
        if state.watch_scope is not None:
            state.watch_scope.cancel()
        self.feed.wake()

    # --- what the nodes report (edge.fleet.feed) ------------------------------------------

    async def refresh(self) -> None:
        """Ask every node for its models, concurrently (at startup, and in tests)."""
        await self.feed.refresh()

    async def run_refresh(self, interval: float | None = None) -> None:
        """Keep every node's health, forever (in the daemon's nursery): `NodeFeed`."""
        await self.feed.run_refresh(interval)

    def available(self) -> None:
        if self.on_available is not None:
            self.on_available()

    # --- what the run side reports --------------------------------------------------------

    def mark_down(self, state: NodeState, reason: str) -> None:
        """The node refused a run: out of routing until its Describe answers again (or,
        watched, its first report on a new subscription)."""
        if state.health.mark_down(self._clock(), reason):
            logger.warning("node {} is down: {}", state.client.name, clip(reason))
            if state.watch_scope is not None:
                state.watch_scope.cancel()
        self.feed.wake()

    def run_succeeded(self, state: NodeState) -> None:
        """A run on `state` got its first event, or completed."""
        if state.health.run_succeeded(self._clock()):
            logger.info("node {} takes runs again (a run succeeded)", state.client.name)
            self.available()
            self.feed.wake()

    def run_failed(self, state: NodeState, reason: str, *, started_at: float | None = None) -> None:
        """A run on `state` could not start, broke, or failed before any output, by the
        node's doing (`reason`: the verdict, `Verdict.counts_on_breaker`).

        Counted by the breaker when the run started on the node as it is now (not
        before it last came up: a dead process's runs say nothing of the restarted
        one).
        """
        if started_at is not None and started_at < state.health.up_since:
            return
        if state.health.run_failed(self._clock()):
            logger.warning(
                "node {}: circuit open after {} failed run(s) in a row, last: {};"
                " no new runs for {:g}s",
                state.client.name, state.health.breaker.failures, clip(reason),
                self.policy.cooldown_s,
            )  # fmt: skip
            self.feed.wake()

    def run_usage(self, state: NodeState, blocks: array[int], predicted: int, usage: Usage) -> None:
        """A run of `blocks` on `state`, for which the pick predicted `predicted` cached
        blocks, reported its usage: the node's cache index is corrected by its cached
        input tokens (cache_aware; `CacheIndex.corrected`)."""
        if self.cache_aware and blocks:
            state.cache.corrected(blocks, predicted, usage.cached_input_tokens // BLOCK_TOKENS)

    def run_refused(self, state: NodeState) -> None:
        """A run on `state` that the node refused (4xx: the request's fault) or was too
        busy for (429): nothing for the breaker; a half-open probe is free again."""
        if state.health.run_refused(self._clock()):
            self.available()
            self.feed.wake()

    # --- picking a node ----------------------------------------------------------------

    def pick(
        self,
        model: str,
        *,
        logprobs: bool = False,
        exclude: Collection[NodeState] = (),
        affinity_key: SessionKey | None = None,
        route: Route | None = None,
    ) -> NodeState | None:
        """A node for a new run of `model`, or None when the nodes that could take it have
        no free slot right now (the caller queues).

        With `logprobs`, only a node that gives logprobs for the model: when
        every node known to serve it says it cannot, the request is the
        caller's to change (400, `param: "logprobs"`), before any run starts.
        A half-open node picked gets this run as its one probe. Under the cache-aware
        policy, `route` is the request's prefix blocks: the node picked is recorded as
        holding them, and `route.predicted` set to its cached prefix.
        """
        now = self._clock()
        known = capable = False
        healthy: list[NodeState] = []
        down: list[NodeState] = []
        blocked = False  # a node up but with its breaker open (or its probe run out)
        for state in self.nodes:
            if model not in state.models:
                continue
            known = True
            if logprobs and model not in state.logprobs_models:
                continue
            capable = True
            if state in exclude:
                continue
            if not state.health.up:
                down.append(state)
            elif state.health.admits(now):
                healthy.append(state)
            else:
                blocked = True
        if healthy:
            free = [s for s in healthy if s.has_slot()]
            if not free:
                return None
            turn = self._turn  # the first pick's ties go to the first listed, then round
            self._turn = turn + 1
            if self.cache_aware and route is not None:
                choice = self._choose_cached(free, affinity_key, route, turn)
                chosen = free[choice.index]
            else:
                choice, chosen = None, self._choose(free, affinity_key, turn)
            if len(free) < len(healthy) and _queued_behind(chosen, healthy):
                return None  # wait here for a place on a node without that queue
            chosen.health.breaker.take(now, self.policy.cooldown_s)
            if choice is not None and route is not None:
                self._routed(chosen, route, choice)
            return chosen
        if down and not blocked:
            # Panic routing: every node that could serve the model is marked down; try
            # the one that failed least recently rather than fail outright.
            free = [s for s in down if s.has_slot()]
            if not free:
                return None
            chosen = min(free, key=lambda s: s.health.last_failed_at)
            logger.debug(
                "panic routing: every node for {} is down, trying node {}",
                clip(model), chosen.client.name,
            )  # fmt: skip
            return chosen
        if known and not capable:
            raise RequestError(
                f"The model {model!r} is served by nodes that do not give logprobs;"
                " send the request without 'logprobs' and 'top_logprobs'.",
                param="logprobs",
            )
        if blocked:
            raise NodeUnavailableError(
                f"no node is available for model {model!r} (circuit breaker open); retry later"
            )
        if known or any(not s.healthy for s in self.nodes):
            raise NodeUnavailableError(f"no node is available for model {model!r}; retry later")
        raise NotFoundError(
            f"The model {model!r} does not exist or is not served here.",
            param="model",
            code="model_not_found",
        )

    def _choose(
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

    def _choose_cached(
        self, free: list[NodeState], affinity_key: SessionKey | None, route: Route, turn: int
    ) -> cacheaware.Choice:
        # Only a session the client named is pinned (`SessionKey` says why).
        session = affinity_key.key if affinity_key is not None and affinity_key.named else None
        ranks = load.comparable([s.rank() for s in free])
        candidates = [
            Candidate(
                s.client.name,
                load.runs(s.load, s.in_flight, s.at_report),
                rank,
                s.cache,
                share=self.shares[s.client.name],
            )
            for s, rank in zip(free, ranks, strict=True)
        ]
        return cacheaware.choose(
            route.blocks, candidates, session=session, factor=self.cache_load_factor,
            share_factor=self.cache_share_factor, threshold=self.cache_threshold,
            placements=self.placements, turn=turn, tick=self.dispatches,
        )  # fmt: skip

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

    @property
    def dispatches(self) -> int:
        """The runs this edge routed by cache so far (the clock of the nodes' live demand)."""
        return self.shares.events

    # --- what the edge shows (edge.fleet.readiness) -------------------------------------

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for state in self.nodes:
            for model in state.models:
                seen.setdefault(model, None)
        return list(seen)

    def state_of(self, state: NodeState) -> NodeStateName:
        """`up`, `down`, `open` or `half_open` (see edge.fleet.health)."""
        return state.health.state(self._clock())

    async def aclose(self) -> None:
        for state in self.nodes:
            await state.client.aclose()
