"""Failover: the attempts of one answer, up to the point where its status is committed.

A chat request's answer starts here, streaming or not:

    committed = await failover.start(scope, request, payload, new_session, keepalive_s=...)

An attempt is one `Run` on one node: a slot from the admission queue
(`edge.fleet.admission`), the start, the accept, then output up to the commit
point (`MovableRun.first_batch`: the first batch beyond the role chunk, the first
keep-alive, or the session's terminal; a non-streaming answer's is its
end). Nothing was sent to the caller
before that point, so an attempt that failed there on the node's side
(`Run.failed_over`: unreachable, refused, no accept in time, an error event
or a broken stream before any output) is tried again on another node (the
nodes tried are excluded), up to `[routing] retries` times, after a
jittered exponential backoff. Never after the commit point: from there the
answer is the committed run's, errors included (an error frame), unless it
breaks where another node can continue it: each attempt's answer is a
`edge.fleet.migration.MovableRun`, which moves it (a stream past the commit
point; a non-streaming answer once output came, rather than restarting it
here; when it cannot move, it fails over).

A run is never live on two nodes: an attempt that may have reached its
node is dropped only once its read task is over, CancelRun included
(bounded; a node that cannot be told gets no successor). Every attempt
keeps the request's run id (one response id for the caller; a node's runs
log and the edge's log name the same run), the request's total deadline
and its RunRequest (serialized once, off the loop), and gets a fresh
session. Each slot taken comes back on every path, a retry's included.
Each retry is logged with the request id and counted
(`iop_edge_retries_total{node,reason}`); the request is counted once, from
the attempt that answers it (`RequestScope.adopt`).

This module knows runs and the admission queue, not HTTP: the caller turns
a committed run into a response (`Committed.error`: a real status).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import trio
from loguru import logger

from edge.api.request import ChatRequest
from edge.config import RoutingConfig, TimeoutsConfig
from edge.errors import EdgeError
from edge.fleet.affinity import SessionKey
from edge.fleet.cacheaware import Route
from edge.fleet.migration import CANCEL_WAIT_S, MigrationScope, MovableRun, Mover
from edge.fleet.nodestate import NodeState, Tried
from edge.fleet.run import Run
from edge.fleet.runs import RunPlan, Runs
from edge.node.wire import PreparedRunRequest
from edge.stream.output import ErrorOut, OutEvent
from edge.stream.session import StreamSession


class RequestScope(MigrationScope, Protocol):
    """What failover needs of the request it serves (`edge.http.scope.ChatScope`)."""

    @property
    def request_id(self) -> str: ...

    @property
    def api(self) -> str: ...

    @property
    def node_metadata(self) -> Mapping[str, str] | None:
        """What goes with each Run call (the trace context; None: tracing is off)."""

    def slot_wait(self, began: float, queued_at: float | None) -> None:
        """The wait for the first node slot, from `began`; `queued_at`: when it was queued."""


@dataclass(frozen=True, slots=True)
class Committed:
    """The run that answers the request, and its output up to the commit point.

    Nothing of `first` was sent yet; `keepalive` says the commit point was a
    keep-alive (the body starts with one).
    """

    run: MovableRun
    first: list[OutEvent]
    keepalive: bool

    @property
    def error(self) -> ErrorOut | None:
        """The answer's error when the run failed before any byte: a real HTTP status."""
        if self.keepalive or self.run.output_seen:
            return None
        for event in self.first:
            if type(event) is ErrorOut:
                return event
        return None


def backoff_s(base: float, retry: int) -> float:
    """The wait before retry number `retry` (1, 2, ...): doubling, jittered by +-50%."""
    return float(base * 2 ** (retry - 1) * random.uniform(0.5, 1.5))


class Failover:
    """Starts answers: the attempts of each, on the pool's nodes (see the module doc)."""

    def __init__(
        self, runs: Runs, routing: RoutingConfig, timeouts: TimeoutsConfig | None = None
    ) -> None:
        """`routing` and `timeouts` (default: the runs') are those of one configuration:
        a reload makes another `Failover` on the same runs, and a request keeps the one
        it arrived under to its end."""
        self.runs = runs
        self.routing = routing
        self.timeouts = runs.timeouts if timeouts is None else timeouts

    async def start(
        self,
        scope: RequestScope,
        request: ChatRequest,
        payload: PreparedRunRequest,
        new_session: Callable[[], StreamSession],
        *,
        keepalive_s: float = 0.0,
        affinity_key: SessionKey | None = None,
    ) -> Committed:
        """The committed run of `request`, or the EdgeError of its last attempt's start.

        `payload` is the request's RunRequest, serialized once: every attempt sends
        it (with its own node deadline).

        Raises what admission raises for the first attempt (no node serves the
        model, overloaded). A failed attempt is retried only once another node's
        slot is taken for it (queued first when every other node is busy): with
        none, the failure answers.

        Every slot taken comes back, whatever raises and wherever: a slot is this
        function's (`slot`) until a run is opened on it, then the run's (given back
        with its outcome; `Run.abandon` for a run that fails before its start).
        """
        runs = self.runs
        admission = runs.admission
        retries = self.routing.retries
        began = trio.current_time()
        deadline = began + self.timeouts.total_s
        queued: list[float] = []
        slot: NodeState | None = None  # a slot taken here that no run holds yet
        prefix = payload.prefix
        route = Route(prefix.blocks) if prefix is not None and prefix.blocks else None
        run: Run | None = None  # the attempt under way (its run answering now)
        moving: MovableRun | None = None
        try:
            try:
                slot = await admission.acquire(
                    request.model, logprobs=request.logprobs, affinity_key=affinity_key,
                    route=route, on_queue=queued.append,
                )  # fmt: skip
            finally:
                scope.slot_wait(began, queued[0] if queued else None)
            plan = RunPlan(
                request, payload, deadline, request_id=scope.request_id, api=scope.api,
                keepalive_s=keepalive_s, metadata=scope.node_metadata,
                affinity_key=affinity_key, route=route, timeouts=self.timeouts,
            )  # fmt: skip
            tried = Tried()
            # An answer that breaks after output moves to another node (the nodes tried
            # excluded), at most `migrations` times a request (`edge.fleet.migration`).
            mover = Mover(runs, scope, plan, self.routing.migrations, tried)
            for attempt in range(retries + 1):
                node = slot
                assert node is not None  # taken above, or for this retry
                run = runs.open(node, scope.nursery, plan, new_session())
                slot = None  # the run's now
                moving = MovableRun(run, mover)
                first: list[OutEvent] = []
                try:
                    await scope.hold(run)
                except EdgeError:
                    if not run.failed_over:
                        raise
                else:
                    first, keepalive = await moving.first_batch()
                    run = moving.leg  # the run that answers now (another, if it moved)
                    committed = run.output_seen and request.stream
                    if keepalive or committed or not run.session.terminated:
                        scope.adopt(run)
                        return Committed(moving, first, keepalive)
                    await run.end()  # it failed before any output: its verdict decides
                    if not run.failed_over:
                        scope.adopt(run)
                        return Committed(moving, first, False)
                # The run failed before any byte, on its node's side: another node?
                if attempt < retries and trio.current_time() < deadline:
                    # The node of the run that failed (another than `node` when its
                    # answer moved before any output), in the life it reached (`Tried`).
                    if (failed := run.node) is not None:
                        tried.add(failed, run.life)
                    slot = await self._next_node(request, tried, affinity_key, route)
                if slot is None or not await self._dropped(run, attempt, deadline):
                    if run.start_error is not None:
                        raise run.start_error
                    scope.adopt(run)
                    return Committed(moving, first, False)  # `slot`, if any, given back below
                run = moving = None  # let go: its outcome is fixed, the next attempt answers
                await trio.sleep(backoff_s(self.routing.retry_backoff_s, attempt + 1))
            raise AssertionError("unreachable: the last attempt answers")
        except BaseException as exc:
            if moving is not None:
                run = moving.leg  # a run that moved was handed over; its successor holds
            if run is not None:
                run.abandon(exc)  # never started: its slot back (a started one ends with the scope)
                scope.adopt(run)
            raise
        finally:
            if slot is not None:
                admission.release(slot)

    async def _next_node(
        self,
        request: ChatRequest,
        tried: Tried,
        affinity_key: SessionKey | None,
        route: Route | None,
    ) -> NodeState | None:
        """Another node for a retry, its slot taken (queued first); None: there is none."""
        try:
            return await self.runs.admission.acquire(
                request.model, logprobs=request.logprobs, exclude=tried,
                affinity_key=affinity_key, route=route, first=True,
            )  # fmt: skip
        except EdgeError:
            return None

    async def _dropped(self, run: Run, attempt: int, deadline: float) -> bool:
        """Let `run` go for a retry once its node was told (CancelRun); False: keep it
        (its node may still run it, or the request's deadline passed meanwhile)."""
        handle = run.handle
        if handle is not None:
            with trio.move_on_at(min(trio.current_time() + CANCEL_WAIT_S, deadline)):
                await handle.done.wait()
            if not handle.done.is_set():
                return False  # the node may still run it: no second node gets it
        if trio.current_time() >= deadline:
            return False
        info = run.info
        reason = run.verdict or "unknown"
        metrics = self.runs.metrics
        metrics.retries.labels(info.node, reason).inc()
        if reason == "error_event":  # counted with the request's outcome otherwise
            metrics.node_errors.labels(info.node, "error_event").inc()
        logger.bind(
            request_id=info.request_id, run_id=info.run_id, node=info.node, reason=reason,
            retry=attempt + 1,
        ).warning("run {} failed on node {} before any output ({}); retry {} of {} on another"
                  " node", info.run_id, info.node, reason, attempt + 1,
                  self.routing.retries)  # fmt: skip
        return True
