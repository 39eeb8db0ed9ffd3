"""The nodes an edge routes to: their models, health, slots, and the pick of one per run.

The pool learns each node's models (and its max_runs) from its Describe RPC,
in one background task (`run_refresh`): healthy nodes every refresh
interval, down or suspect nodes soon and with backoff (`edge.fleet.health`),
and the breakers' half-opening on time. Nothing of it runs per request:
`pick` only reads the states, and the run side reports each run's verdict
(`run_succeeded`, `run_failed`) and refusals (`mark_down`).

`pick` chooses a node for a new run: one serving the model, healthy (up,
its breaker closed or half-open with the probe run free), not excluded
(the nodes a failing-over run already tried), with a free slot
(`in_flight < max_runs`); least loaded, or the session's node under the
affinity policy (`edge.fleet.affinity`). When every node serving the model
(and not excluded) is marked down, panic routing tries one anyway, the one
that failed least recently: a down mark may be stale, and answering 503
outright would turn a blip into an outage. An open breaker is not stale: a
node behind one gets no run, panic or not. `pick` raises the edge's errors:
NotFoundError for a model no node serves, NodeUnavailableError when the
nodes that could serve it are excluded, down or behind an open breaker and
none is left to try.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

import trio
from loguru import logger

from edge.config import RoutingConfig
from edge.errors import NodeUnavailableError, NotFoundError, RequestError
from edge.fleet import affinity
from edge.fleet.health import STATE_VALUES, HealthPolicy, NodeHealth, NodeStateName
from edge.node.client import NodeClient, NodeDescription
from edge.observe.logbound import clip, clip_join

REFRESH_INTERVAL_S = 5.0


# Run failures the breaker counts: the node's error before output, a start it
# failed, an accept that never came, a stream that broke. Not "timeout" (the
# edge's own deadline on a long or slow answer: an overloaded machine times out
# on every node alike, and opening breakers then only moves the load until all
# are open) nor "unavailable" (a refused start marks the node down instead).
BREAKER_REASONS = frozenset({"error_event", "start_failed", "accept_timeout", "stream_broken"})


class NodeState:
    """One node as the pool sees it: client, models, health, runs in flight and its cap.

    Compared by identity (a set of the nodes a run tried holds these).
    """

    __slots__ = (
        "client",
        "configured_max_runs",
        "describing",
        "description",
        "health",
        "in_flight",
        "logprobs_models",
        "max_runs",
        "models",
    )

    def __init__(
        self,
        client: NodeClient,
        health: NodeHealth | None = None,
        *,
        max_runs: int | None = None,
    ) -> None:
        self.client = client
        self.health = health if health is not None else NodeHealth(HealthPolicy())
        self.models: tuple[str, ...] = ()
        # The models it gives token logprobs for (a node older than the field: none).
        self.logprobs_models: frozenset[str] = frozenset()
        # Runs in flight, counted by the run side (edge.fleet.run).
        self.in_flight = 0
        # [[nodes]] max_runs (0: no limit), None: the node's Describe max_runs.
        self.configured_max_runs = max_runs
        # Runs in flight it takes at once (inf: no limit).
        self.max_runs: float = _max_runs(max_runs, None)
        self.description: NodeDescription | None = None
        self.describing = False

    @property
    def healthy(self) -> bool:
        """Reachable: it answered its last Describe (or run) and refused no run since."""
        return self.health.up

    @property
    def error(self) -> str | None:
        return self.health.reason

    def has_slot(self) -> bool:
        return self.in_flight < self.max_runs

    def __repr__(self) -> str:
        return f"NodeState({self.client.name!r}, in_flight={self.in_flight})"


def _max_runs(configured: int | None, described: NodeDescription | None) -> float:
    if configured is not None:
        return configured or math.inf
    if described is not None and described.max_runs:
        return described.max_runs
    return math.inf


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
        routing = routing if routing is not None else RoutingConfig()
        self.policy = HealthPolicy(
            breaker_failures=routing.breaker_failures,
            cooldown_s=routing.breaker_cooldown_s,
            refresh_s=refresh_s,
        )
        self.affinity = routing.policy == "affinity"
        caps = max_runs or {}
        self.nodes = [
            NodeState(c, NodeHealth(self.policy), max_runs=caps.get(c.name)) for c in clients
        ]
        self.on_available: Callable[[], None] | None = None
        self._clock = clock
        self._changed = trio.Event()

    # --- the background task ------------------------------------------------------------

    async def refresh(self) -> None:
        """Ask every node for its models, concurrently (at startup, and in tests)."""
        async with trio.open_nursery() as nursery:
            for state in self.nodes:
                nursery.start_soon(self._refresh_one, state)

    async def run_refresh(self, interval: float | None = None) -> None:
        """Keep every node's health, forever (in the daemon's nursery).

        Each node is asked when its health says (at most one Describe each at a
        time, so a node that takes its whole Describe timeout holds up no other);
        in between the task sleeps until the next thing due, or until a run's
        verdict or a refusal changed a schedule.
        """
        if interval is not None and interval != self.policy.refresh_s:
            self.policy = replace(self.policy, refresh_s=interval)
            for state in self.nodes:
                state.health.policy = self.policy
        async with trio.open_nursery() as nursery:
            while True:
                self._changed = trio.Event()
                now = self._clock()
                wake = math.inf
                for state in self.nodes:
                    health = state.health
                    if health.advance(now):
                        logger.info(
                            "node {}: circuit half-open, one probe run may start", state.client.name
                        )
                        self._available()
                    if not state.describing and health.next_check <= now:
                        state.describing = True
                        nursery.start_soon(self._refresh_one, state)
                    wake = min(wake, health.wake_at(describing=state.describing))
                with trio.move_on_at(wake):
                    await self._changed.wait()

    def _wake(self) -> None:
        """Something changed a node's schedule: the background task looks again."""
        self._changed.set()

    async def _refresh_one(self, state: NodeState) -> None:
        state.describing = True
        try:
            description = await state.client.describe()
        except Exception as exc:  # EdgeError, TooSlowError, or a bug: never kill the pool
            reason = str(exc) or type(exc).__name__
            if state.health.describe_failed(self._clock(), reason):
                logger.warning("node {} is down: {}", state.client.name, clip(reason))
            return
        else:
            self._described(state, description)
        finally:
            state.describing = False
            self._wake()

    def _described(self, state: NodeState, description: NodeDescription) -> None:
        came_up = state.health.describe_ok(self._clock())
        if came_up:
            logger.info(
                "node {} is up, models: {}", state.client.name, clip_join(description.models)
            )
        old_cap, old_models = state.max_runs, state.models
        state.models = description.models
        state.logprobs_models = description.logprobs_models
        state.description = description
        state.max_runs = _max_runs(state.configured_max_runs, description)
        if came_up or state.max_runs > old_cap or set(state.models) - set(old_models):
            self._available()

    def _available(self) -> None:
        if self.on_available is not None:
            self.on_available()

    # --- what the run side reports --------------------------------------------------------

    def mark_down(self, state: NodeState, reason: str) -> None:
        """The node refused a run: out of routing until its Describe answers again."""
        if state.health.mark_down(self._clock(), reason):
            logger.warning("node {} is down: {}", state.client.name, clip(reason))
        self._wake()

    def run_succeeded(self, state: NodeState) -> None:
        """A run on `state` got its first event, or completed."""
        if state.health.run_succeeded(self._clock()):
            logger.info("node {} takes runs again (a run succeeded)", state.client.name)
            self._available()
            self._wake()

    def run_failed(self, state: NodeState, reason: str, *, started_at: float | None = None) -> None:
        """A run on `state` could not start, broke, or failed before any output.

        Counted by the breaker when `reason` is the node's doing (BREAKER_REASONS: not
        the edge's own deadline, which load alone can bring) and the run started on
        the node as it is now (not before it last came up: a dead process's runs say
        nothing of the restarted one).
        """
        if reason not in BREAKER_REASONS:
            return
        if started_at is not None and started_at < state.health.up_since:
            return
        if state.health.run_failed(self._clock()):
            logger.warning(
                "node {}: circuit open after {} failed run(s) in a row, last: {};"
                " no new runs for {:g}s",
                state.client.name, state.health.run_failures, clip(reason), self.policy.cooldown_s,
            )  # fmt: skip
            self._wake()

    def run_refused(self, state: NodeState) -> None:
        """A run on `state` that the node refused (4xx: the request's fault) or was too
        busy for (429): nothing for the breaker; a half-open probe is free again."""
        if state.health.run_refused(self._clock()):
            self._available()
            self._wake()

    # --- picking a node ----------------------------------------------------------------

    def pick(
        self,
        model: str,
        *,
        logprobs: bool = False,
        exclude: Collection[NodeState] = (),
        affinity_key: str | None = None,
    ) -> NodeState | None:
        """A node for a new run of `model`, or None when the nodes that could take it have
        no free slot right now (the caller queues).

        With `logprobs`, only a node that gives logprobs for the model: when
        every node known to serve it says it cannot, the request is the
        caller's to change (400, `param: "logprobs"`), before any run starts.
        A half-open node picked gets this run as its one probe.
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
            chosen = self._choose(free, affinity_key)
            chosen.health.take(now)
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

    def _choose(self, free: list[NodeState], affinity_key: str | None) -> NodeState:
        if self.affinity and affinity_key is not None and len(free) > 1:
            i = affinity.choose(affinity_key, [(s.client.name, s.in_flight) for s in free])
            return free[i]
        best = free[0]
        for state in free[1:]:
            if state.in_flight < best.in_flight:
                best = state
        return best

    # --- what the edge shows -------------------------------------------------------------

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for state in self.nodes:
            for model in state.models:
                seen.setdefault(model, None)
        return list(seen)

    def state_of(self, state: NodeState) -> NodeStateName:
        """`up`, `down`, `open` or `half_open` (see edge.fleet.health)."""
        return state.health.state(self._clock())

    def state_value(self, state: NodeState) -> float:
        """The node's state as the iop_edge_node_state gauge shows it."""
        return STATE_VALUES[self.state_of(state)]

    @property
    def ready(self) -> bool:
        """Whether some node may take runs: up, or its breaker half-open."""
        return any(self.state_of(s) in ("up", "half_open") for s in self.nodes)

    def status(self) -> list[dict[str, object]]:
        return [
            {
                "name": s.client.name,
                "address": s.client.address,
                "state": self.state_of(s),
                "healthy": s.healthy,
                "models": list(s.models),
                "in_flight": s.in_flight,
                "max_runs": None if math.isinf(s.max_runs) else int(s.max_runs),
                "failed_runs_in_a_row": s.health.run_failures,
                **({"error": s.error} if s.error else {}),
            }
            for s in self.nodes
        ]

    async def aclose(self) -> None:
        for state in self.nodes:
            await state.client.aclose()
