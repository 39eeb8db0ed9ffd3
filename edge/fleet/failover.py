"""Failover: the attempts of one answer, up to the point where its status is committed.

A chat request's answer (`edge.fleet.answer.Answer`) starts here, streaming
or not, from its plan (`Failover.plan`: what every run of it starts from):

    plan = failover.plan(request, payload, request_id=..., keepalive_s=...)
    committed = await failover.start(answer, plan, new_session)

An attempt is one `Run` on one node: a slot from the admission queue
(`edge.fleet.admission`), the start, the accept, then output up to the commit
point (`Answer.first_batch`: the first batch beyond the role chunk, the first
keep-alive, or the session's terminal; a non-streaming answer's is its
end). Nothing was sent to the caller
before that point, so an attempt that failed there on the node's side
(`Run.failed_over`: unreachable, refused, no accept in time, an error event
or a broken stream before any output) is tried again on another node (the
nodes tried are excluded), up to `[routing] retries` times, after a
jittered exponential backoff. Never after the commit point: from there the
answer is the committed run's, errors included (an error frame), unless it
breaks where another node can continue it: the answer moves
(`edge.fleet.migration`: a stream past the commit point; a non-streaming
answer once output came, rather than restarting it here; when it cannot
move, it fails over).

A run is never live on two nodes: an attempt that may have reached its
node is dropped only once its read task is over, CancelRun included
(bounded; a node that cannot be told gets no successor). Every attempt
keeps the request's run id (one response id for the caller; a node's runs
log and the edge's log name the same run), the request's total deadline
and its RunRequest (serialized once, off the loop), and gets a fresh
session. Each slot taken comes back on every path, a retry's included.
Each retry is logged with the request id and counted
(`iop_edge_retries_total{node,reason}`) and journaled; the request is
counted once, from the attempt that answers it (`Answer.adopt`).

This module knows runs and the admission queue, not HTTP: the caller turns
a committed run into a response (`Committed.error`: a real status).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio
from loguru import logger

from edge.api.request import ChatRequest
from edge.config import RoutingConfig, TimeoutsConfig
from edge.errors import EdgeError
from edge.fleet.affinity import SessionKey
from edge.fleet.answer import Answer, Mark
from edge.fleet.cacheaware import Route
from edge.fleet.migration import CANCEL_WAIT_S, Mover
from edge.fleet.nodestate import NodeState, Tried
from edge.fleet.run import Run
from edge.fleet.runs import RunPlan, Runs
from edge.fleet.tenants import Tenant
from edge.node.wire import PreparedRunRequest
from edge.stream.output import ErrorOut, OutEvent
from edge.stream.session import StreamSession


@dataclass(frozen=True, slots=True)
class Committed:
    """The run that answers the request, and its output up to the commit point.

    Nothing of `first` was sent yet; `keepalive` says the commit point was a
    keep-alive (the body starts with one).
    """

    answer: Answer
    first: list[OutEvent]
    keepalive: bool

    @property
    def error(self) -> ErrorOut | None:
        """The answer's error when the run failed before any byte: a real HTTP status."""
        leg = self.answer.leg
        if self.keepalive or (leg is not None and leg.reader.output_seen):
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

    def plan(
        self,
        request: ChatRequest,
        payload: PreparedRunRequest,
        *,
        request_id: str = "",
        api: str = "chat",
        keepalive_s: float = 0.0,
        metadata: Mapping[str, str] | None = None,
        affinity_key: SessionKey | None = None,
        tenant: Tenant | None = None,
        tier: str = "default",
    ) -> RunPlan:
        """What every run of `request` starts from: its total deadline counts from now,
        under this configuration's timeouts; its route is its RunRequest's prefix."""
        prefix = payload.prefix
        route = Route(prefix.blocks) if prefix is not None and prefix.blocks else None
        return RunPlan(
            request, payload, trio.current_time() + self.timeouts.total_s,
            request_id=request_id, api=api, keepalive_s=keepalive_s, metadata=metadata,
            affinity_key=affinity_key, route=route, timeouts=self.timeouts, tenant=tenant,
            tier=tier,
        )  # fmt: skip

    async def start(
        self, answer: Answer, plan: RunPlan, new_session: Callable[[], StreamSession]
    ) -> Committed:
        """`answer`'s committed run, or the EdgeError of its last attempt's start.

        Every attempt sends the plan's RunRequest (with its own node deadline), with a
        fresh session. Raises what admission raises for the first attempt (no node
        serves the model, overloaded). A failed attempt is retried only once another
        node's slot is taken for it (queued first when every other node is busy): with
        none, the failure answers.

        Every slot taken comes back, whatever raises and wherever: a slot is this
        function's (`slot`) until a run is opened on it, then the run's (given back
        with its outcome; `Run.abandon` for a run that fails before its start).
        """
        runs = self.runs
        retries = self.routing.retries
        slot: NodeState | None = None  # a slot taken here that no run holds yet
        try:
            slot = await self._first_node(answer, plan)
            tried = Tried()
            # An answer that breaks after output moves to another node (the nodes tried
            # excluded), at most `migrations` times a request (`edge.fleet.migration`).
            mover = Mover(runs, answer, plan, self.routing.migrations, tried)
            answer.mover = mover
            for attempt in range(retries + 1):
                assert slot is not None  # taken above, or for this retry
                run = runs.open(slot, answer.nursery, plan, new_session())
                slot = None  # the run's now
                answer.leg = run
                mover.track(run)
                committed, first = await self._attempt(answer, run)
                if committed is not None:
                    return committed
                # The run failed before any byte, on its node's side: another node?
                leg = answer.leg  # another than the one opened when it moved before output
                assert leg is not None
                run = leg
                if attempt < retries and trio.current_time() < plan.deadline:
                    if (failed := run.node) is not None:
                        tried.add(failed, run.life)  # the life it reached (`Tried`)
                    slot = await self._next_node(plan, tried)
                if slot is None or not await self._dropped(run, attempt, plan.deadline):
                    if run.start_error is not None:
                        raise run.start_error
                    answer.adopt(run)
                    return Committed(answer, first, False)  # `slot`, if any, given back below
                answer.leg = None  # let go: its outcome is fixed, the next attempt answers
                answer.journal.append(
                    Mark("retried", trio.current_time(), run.info.node, run.verdict or "unknown")
                )
                await trio.sleep(backoff_s(self.routing.retry_backoff_s, attempt + 1))
            raise AssertionError("unreachable: the last attempt answers")
        except BaseException as exc:
            if (under_way := answer.leg) is not None:
                # Never started: its slot back (a started one ends with the answer).
                under_way.abandon(exc)
                answer.adopt(under_way)
            raise
        finally:
            if slot is not None:
                runs.admission.release(slot)

    async def _first_node(self, answer: Answer, plan: RunPlan) -> NodeState:
        """The first attempt's node, its slot taken (queued first when none is free)."""
        began = trio.current_time()
        queued: list[float] = []
        request = plan.request
        try:
            return await self.runs.admission.acquire(
                request.model, logprobs=request.logprobs, affinity_key=plan.affinity_key,
                route=plan.route, on_queue=queued.append, tenant=plan.tenant, tier=plan.tier,
            )  # fmt: skip
        finally:
            answer.queue_s = trio.current_time() - began
            if queued:
                answer.journal.append(Mark("queued", queued[0]))

    async def _attempt(self, answer: Answer, run: Run) -> tuple[Committed | None, list[OutEvent]]:
        """Start `run` and take its output up to the commit point: the committed answer,
        or None when the run failed before any byte on its node's side (another node
        may serve it), with what it took."""
        first: list[OutEvent] = []
        try:
            await answer.hold(run)
        except EdgeError:
            if not run.failed_over:
                raise
            return None, first
        first, keepalive = await answer.first_batch()
        leg = answer.leg  # the run that answers now (another, if it moved)
        assert leg is not None
        committed = leg.reader.output_seen and leg.info.stream
        if keepalive or committed or not leg.session.terminated:
            answer.adopt(leg)
            return Committed(answer, first, keepalive), first
        await leg.end()  # it failed before any output: its verdict decides
        if not leg.failed_over:
            answer.adopt(leg)
            return Committed(answer, first, False), first
        return None, first

    async def _next_node(self, plan: RunPlan, tried: Tried) -> NodeState | None:
        """Another node for a retry, its slot taken (queued first); None: there is none."""
        request = plan.request
        try:
            return await self.runs.admission.acquire(
                request.model, logprobs=request.logprobs, exclude=tried,
                affinity_key=plan.affinity_key, route=plan.route, first=True,
                tenant=plan.tenant, tier=plan.tier,
            )  # fmt: skip
        except EdgeError:
            return None

    async def _dropped(self, run: Run, attempt: int, deadline: float) -> bool:
        """Let `run` go for a retry once its node was told (CancelRun); False: keep it
        (its node may still run it, or the request's deadline passed meanwhile)."""
        handle = run.reader.handle
        if handle is not None:
            with trio.move_on_at(min(trio.current_time() + CANCEL_WAIT_S, deadline)):
                await handle.done.wait()
            if not handle.done.is_set():
                return False  # the node may still run it: no second node gets it
        if trio.current_time() >= deadline:
            return False
        info = run.info
        reason = run.verdict or "unknown"
        self.runs.metrics.retries.labels(info.node, reason).inc()
        logger.bind(
            request_id=info.request_id, run_id=info.run_id, node=info.node, reason=reason,
            retry=attempt + 1,
        ).warning("run {} failed on node {} before any output ({}); retry {} of {} on another"
                  " node", info.run_id, info.node, reason, attempt + 1,
                  self.routing.retries)  # fmt: skip
        return True
