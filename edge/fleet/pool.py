"""The nodes an edge routes to, and the pick of one per run: `NodePool`.
(One node's state is `edge.fleet.nodestate.NodeState`.)

The pool keeps the membership (`add`, `remove`, `set_max_runs`, a reload's
`configure`) and the entry points the run side calls. What each node serves
and how it is (models, max_runs, load, health) is kept by the feed
(`edge.fleet.feed`: each node's Watch stream, or its Describe answers, in one
background task). Nothing of it runs per request: `pick` only reads the
states, and the run side reports each run's verdict (`run_succeeded`,
`run_failed`, `run_refused`), its usage (`run_usage`) and refusals
(`mark_down`, which also ends a watched node's subscription: it is subscribed
to again as a down node is probed). What the edge shows of the nodes
(`/readyz`, the gauges) is `edge.fleet.readiness`.

`pick` chooses a node for a new run: one serving the model, healthy (up,
its breaker closed or half-open with the probe run free), not excluded
(the nodes a failing-over run already tried); among those, the picker
(`edge.fleet.picker`) chooses by the routing policy one with a free slot, or
none (the run waits at the edge). When every node serving the model
(and not excluded) is marked down, panic routing tries one anyway, the one
that failed least recently: a down mark may be stale, and answering 503
outright would turn a blip into an outage. An open breaker is not stale: a
node behind one gets no run, panic or not. `pick` raises the edge's errors:
NotFoundError for a model no node serves, NodeUnavailableError when the
nodes that could serve it are excluded, down or behind an open breaker and
none is left to try, its message saying why, node by node
(`edge.fleet.unavailable`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import trio
from loguru import logger

from edge.config import RoutingConfig
from edge.contract.prefix import BLOCK_TOKENS
from edge.errors import EdgeError, NodeUnavailableError, NotFoundError, RequestError
from edge.fleet.affinity import SessionKey
from edge.fleet.cacheaware import Route
from edge.fleet.feed import NodeFeed
from edge.fleet.health import HealthPolicy, NodeHealth, NodeStateName
from edge.fleet.nodestate import NodeState, max_runs_of
from edge.fleet.picker import Picker
from edge.fleet.unavailable import unavailable_words
from edge.node.client import NodeClient
from edge.observe.logbound import clip
from edge.stream.events import Usage

REFRESH_INTERVAL_S = 5.0


# Run failures the breaker counts: the node's error before output, a start it
# failed, an accept that never came, a stream that broke. Not "timeout" (the
# edge's own deadline on a long or slow answer: an overloaded machine times out
# on every node alike, and opening breakers then only moves the load until all
# are open) nor "unavailable" (a refused start marks the node down instead).


def _health_policy(routing: RoutingConfig, refresh_s: float) -> HealthPolicy:
    """The numbers every node's health runs by: the breaker's from `[routing]`."""
    return HealthPolicy(
        breaker_failures=routing.breaker_failures,
        cooldown_s=routing.breaker_cooldown_s,
        refresh_s=refresh_s,
    )


def _panic(model: str, down: list[NodeState]) -> NodeState | None:
    """Panic routing: every node that could serve `model` is marked down; the one that
    failed least recently is tried rather than fail outright (None: none has a slot)."""
    free = [s for s in down if s.has_slot()]
    if not free:
        return None
    chosen = min(free, key=lambda s: s.health.last_failed_at)
    logger.debug(
        "panic routing: every node for {} is down, trying node {}",
        clip(model), chosen.client.name,
    )  # fmt: skip
    return chosen


def _no_node(
    model: str, nodes: list[NodeState], *, known: bool, capable: bool, why: Callable[[], str]
) -> EdgeError:
    """Why no node can take a run of `model`, as the error the request gets (`why`: the
    words of a 503, `edge.fleet.unavailable`)."""
    if known and not capable:
        return RequestError(
            f"The model {model!r} is served by nodes that do not give logprobs;"
            " send the request without 'logprobs' and 'top_logprobs'.",
            param="logprobs",
        )
    if known or any(not s.healthy for s in nodes):
        return NodeUnavailableError(why())
    return NotFoundError(
        f"The model {model!r} does not exist or is not served here.",
        param="model",
        code="model_not_found",
    )


@dataclass(slots=True)
class Sorted:
    """The nodes for one model's run, sorted by what they can do now (`sort_nodes`)."""

    healthy: list[NodeState] = field(default_factory=list)  # up, admitted by the breaker
    down: list[NodeState] = field(default_factory=list)
    known: bool = False  # some node serves the model
    capable: bool = False  # some node serves it with logprobs, when asked
    blocked: bool = False  # a node up but with its breaker open (or its probe run out)


def sort_nodes(
    nodes: list[NodeState],
    model: str,
    *,
    logprobs: bool = False,
    exclude: Collection[NodeState] = (),
    now: float,
) -> Sorted:
    """`nodes` for a run of `model` at `now`: `healthy` are those `NodePool.pick` chooses
    among (serving it, with logprobs when asked, not excluded, up and admitted by their
    breaker), a free slot or not; what a queued request may wait for."""
    out = Sorted()
    for state in nodes:
        if model not in state.models:
            continue
        out.known = True
        if logprobs and model not in state.logprobs_models:
            continue
        out.capable = True
        if state in exclude:
            continue
        if not state.health.up:
            out.down.append(state)
        elif state.health.admits(now):
            out.healthy.append(state)
        else:
            out.blocked = True
    return out


class NodePool:
    """The edge's nodes: health kept in one background task (`feed`), a node picked per
    run (`pick`; the `picker` chooses among the candidates).

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
        routing = routing if routing is not None else RoutingConfig()
        self.policy = _health_policy(routing, refresh_s)
        self.watch_heartbeat_s = routing.watch_heartbeat_s
        self.picker = Picker(routing)
        self.nodes: list[NodeState] = []
        self.on_available: Callable[[], None] | None = None
        self._clock = clock
        self.feed = NodeFeed(self, clock)
        caps = max_runs or {}
        for client in clients:
            self.add(client, caps.get(client.name))

    # --- what a reload changes ------------------------------------------------------------

    def configure(self, routing: RoutingConfig, refresh_s: float) -> None:
        """A reload's `[routing]` and `[server] node_refresh_s`, from the next pick and
        the next check of each node on (a node's breaker and probes keep their state; a
        new subscription asks for the new heartbeat). Switched to cache_aware, a node's
        index that only ever held one block is sized as a node without a reported
        capacity is."""
        self.policy = _health_policy(routing, refresh_s)
        self.watch_heartbeat_s = routing.watch_heartbeat_s
        picker = self.picker
        picker.configure(routing)
        for state in self.nodes:
            state.health.policy = self.policy
            if picker.cache_aware and not state.cache.exact and state.cache.capacity == 1:
                state.cache.resize(picker.cache_blocks)
        self.feed.wake()

    def add(self, client: NodeClient, max_runs: int | None = None) -> NodeState:
        """A node that joined the configuration (or was there at start). It takes no run
        before it answered: until its first Watch report (or Describe) it serves no model
        (the background task subscribes to it at once; `NodeState.probed` is set once it
        answered, or failed to)."""
        blocks = self.picker.cache_blocks if self.picker.cache_aware else 1
        state = NodeState(client, NodeHealth(self.policy), max_runs=max_runs, cache_blocks=blocks)
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
        if self.picker.cache_aware and blocks:
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
        nodes = sort_nodes(self.nodes, model, logprobs=logprobs, exclude=exclude, now=now)
        healthy, down = nodes.healthy, nodes.down
        if healthy:
            chosen = self.picker.choose(healthy, affinity_key, route)
            if chosen is not None:
                chosen.health.breaker.take(now, self.policy.cooldown_s)
            return chosen
        if down and not nodes.blocked:
            return _panic(model, down)
        raise _no_node(
            model, self.nodes, known=nodes.known, capable=nodes.capable,
            why=lambda: unavailable_words(
                model, self.nodes, now=now, cooldown_s=self.policy.cooldown_s,
                logprobs=logprobs, exclude=exclude,
            ),
        )  # fmt: skip

    # --- what the edge shows (edge.fleet.readiness) -------------------------------------

    def models(self) -> list[str]:
        """The models the nodes serve, each once, in the order the nodes list them."""
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
