"""How the pool learns its nodes: each node's Watch stream, or its Describe answers.

The pool (`edge.fleet.pool`) learns each node's models, max_runs and load
from its Watch stream: one task per node (`_watch`) holds one subscription,
each report is what a Describe answer was plus the node's load
(`edge.fleet.load`). A broken stream, or one silent past its bound, makes
the node suspect at once (as a failed Describe); it is subscribed to again
on the probes' schedule (PROBE_FIRST_S, doubling: `edge.fleet.health`). A
node that answers Watch UNIMPLEMENTED (older than that RPC) is asked with
Describe instead, by the background task (`run_refresh`): healthy nodes
every refresh interval, down or suspect ones soon and with backoff; Watch is
tried again when such a node comes back up from down (it may have been
upgraded). The same task half-opens the breakers on time. Nothing of it runs
per request: the pool's `pick` only reads the states the feed keeps.

Knows the pool only by what it feeds (`Fed`): its nodes, health policy and
routing knobs (its picker's, `edge.fleet.picker`), and whom to tell that a node
may take runs it could not before.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import trio
from loguru import logger

from edge.contract.prefix import BLOCK_TOKENS
from edge.fleet.health import SILENCE_HEARTBEATS, SILENCE_MIN_S, HealthPolicy
from edge.fleet.load import NodeLoad
from edge.fleet.nodestate import NodeState, kv_events, max_runs_of
from edge.fleet.picker import Picker
from edge.node.client import NodeDescription, WatchUnsupported
from edge.observe.logbound import clip, clip_join


class Fed(Protocol):
    """What the feed keeps up to date, and asks of the pool."""

    nodes: list[NodeState]
    policy: HealthPolicy
    watch_heartbeat_s: float
    picker: Picker

    def available(self) -> None:
        """A node may take runs it could not before (up, a higher max_runs, new models)."""


class NodeFeed:
    """Each node's state from its Watch stream or Describe answers (see the module doc)."""

    def __init__(self, pool: Fed, clock: Callable[[], float]) -> None:
        self.pool = pool
        self._clock = clock
        self._changed = trio.Event()

    async def refresh(self) -> None:
        """Ask every node for its models, concurrently (at startup, and in tests)."""
        async with trio.open_nursery() as nursery:
            for state in self.pool.nodes:
                nursery.start_soon(self._refresh_one, state)

    async def run_refresh(self, interval: float | None = None) -> None:
        """Keep every node's health, forever (in the daemon's nursery).

        Each node gets its watch task (`_watch`), or, polled, is asked when
        its health says (at most one Describe each at a time, so a node that
        takes its whole Describe timeout holds up no other); in between the
        task sleeps until the next thing due, or until a run's verdict, a
        refusal or a watch task changed a schedule.
        """
        if interval is not None and interval != self.pool.policy.refresh_s:
            self.pool.policy = replace(self.pool.policy, refresh_s=interval)
            for state in self.pool.nodes:
                state.health.policy = self.pool.policy
        async with trio.open_nursery() as nursery:
            while True:
                self._changed = trio.Event()
                now = self._clock()
                wake = math.inf
                for state in self.pool.nodes:
                    health = state.health
                    if health.advance(now):
                        logger.info(
                            "node {}: circuit half-open, one probe run may start", state.client.name
                        )
                        self.pool.available()
                    if not state.polled:
                        if not state.watching:
                            state.watching = True
                            nursery.start_soon(self._watch, state)
                        # Its watch task keeps its schedule: here only its breaker's.
                        wake = min(wake, health.wake_at(describing=True))
                        continue
                    if not state.describing and health.next_check <= now:
                        state.describing = True
                        nursery.start_soon(self._refresh_one, state)
                    wake = min(wake, health.wake_at(describing=state.describing))
                with trio.move_on_at(wake):
                    await self._changed.wait()

    def wake(self) -> None:
        """Something changed a node's schedule: the background task, and the watch
        tasks waiting for their next subscription, look again."""
        self._changed.set()
        for state in self.pool.nodes:
            state.kick.set()

    # --- Watch ----------------------------------------------------------------------------

    async def _watch(self, state: NodeState) -> None:
        """Keep `state` from its Watch stream while the node has one (the watch task).

        Subscribes at once, then again after each end of the stream, when its
        health says (`next_check`: the probes' backoff). Returns when the node
        answers UNIMPLEMENTED, after asking it with Describe: from then on the
        background task polls it.
        """
        health = state.health
        try:
            first = True
            while not state.retired:
                if not first:
                    await self._next_subscription(state)
                    if state.retired:
                        return
                first = False
                try:
                    with trio.CancelScope() as scope:
                        state.watch_scope = scope
                        reason = await self._subscription(state)
                    if scope.cancelled_caught:
                        continue  # a refused run ended it: the node is down, probed as such
                except WatchUnsupported as exc:
                    logger.info(
                        "node {} is asked with Describe every {:g}s: {}",
                        state.client.name, self.pool.policy.refresh_s, clip(str(exc)),
                    )  # fmt: skip
                    await self._refresh_one(state)
                    state.polled = True
                    return
                except Exception as exc:  # EdgeError, or a bug: never kill the pool
                    reason = str(exc) or type(exc).__name__
                finally:
                    state.watch_scope = None
                    state.load = None
                state.probed.set()
                if health.watch_failed(self._clock(), reason):
                    logger.warning("node {} is down: {}", state.client.name, clip(reason))
        finally:
            state.watching = False
            self.wake()

    async def _subscription(self, state: NodeState) -> str:
        """One subscription, report after report, until it fails (it raises) or a report
        is overdue (returns why)."""
        health = state.health
        health.subscribed(self._clock(), self.pool.watch_heartbeat_s)
        reports = state.client.watch(self.pool.watch_heartbeat_s)
        async with contextlib.aclosing(reports):
            while True:
                with trio.move_on_at(health.silent_at):
                    description = await anext(reports)
                    scope = state.watch_scope
                    if scope is None or not scope.cancel_called:  # not after a refusal
                        self.reported(state, description)
                    continue
                return (
                    f"no Watch report within its silence bound ({SILENCE_HEARTBEATS} heartbeats,"
                    f" at least {SILENCE_MIN_S:g}s)"
                )

    async def _next_subscription(self, state: NodeState) -> None:
        """Wait until the node's next check is due (`next_check`, read again whenever the
        pool's schedules change: a run on the node that succeeded brings it forward)."""
        while self._clock() < state.health.next_check and not state.retired:
            state.kick = trio.Event()
            with trio.move_on_at(state.health.next_check):
                await state.kick.wait()

    def reported(self, state: NodeState, description: NodeDescription) -> None:
        """A Watch report: the node's models and load; this process's runs on it are
        counted from here (the node's numbers now include those it had)."""
        heartbeat_s = (description.heartbeat_ms or self.pool.watch_heartbeat_s * 1000) / 1000
        came_up = state.health.reported(self._clock(), heartbeat_s)
        self._learned(state, description, came_up)
        state.load = NodeLoad.of(description)
        state.at_report = state.in_flight
        if self.pool.picker.cache_aware:
            kv_events(state.cache, description, self.pool.picker.dispatches)

    async def _refresh_one(self, state: NodeState) -> None:
        state.describing = True
        try:
            description = await state.client.describe()
        except Exception as exc:  # EdgeError, TooSlowError, or a bug: never kill the pool
            reason = str(exc) or type(exc).__name__
            state.probed.set()
            if state.health.describe_failed(self._clock(), reason):
                logger.warning("node {} is down: {}", state.client.name, clip(reason))
            return
        else:
            self.described(state, description)
        finally:
            state.describing = False
            self.wake()

    def described(self, state: NodeState, description: NodeDescription) -> None:
        came_up = state.health.describe_ok(self._clock())
        if came_up:
            state.polled = False  # back from down: Watch is tried again
        self._learned(state, description, came_up)

    def _learned(self, state: NodeState, description: NodeDescription, came_up: bool) -> None:
        state.probed.set()
        if came_up:
            logger.info(
                "node {} is up, models: {}", state.client.name, clip_join(description.models)
            )
        old_cap, old_models = state.max_runs, state.models
        old = state.description
        if old is not None and old.instance and description.instance != old.instance:
            # A new process: what this edge knew of its KV cache went with the old one.
            logger.info("node {} restarted (a new instance)", state.client.name)
            state.cache.clear()
            state.past_instances.append(old.instance)
        state.models = description.models
        state.logprobs_models = description.logprobs_models
        state.continuation_models = description.continuation_models
        state.description = description
        state.max_runs = max_runs_of(state.configured_max_runs, description)
        if self.pool.picker.cache_aware:
            tokens = description.kv_cache_tokens
            if tokens:
                state.cache.resize(tokens // BLOCK_TOKENS)
            elif not state.cache.exact:
                state.cache.resize(self.pool.picker.cache_blocks)
        if came_up or state.max_runs > old_cap or set(state.models) - set(old_models):
            self.pool.available()
