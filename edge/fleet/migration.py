"""Migration: an answer whose run breaks after output goes on on another node.

A request's answer (`edge.fleet.answer.Answer`) is taken from one run at a
time (`Answer.leg`); its `Mover` (set by `edge.fleet.failover`) moves it:

    batch = await answer.next_batch()      # the HTTP writer does not know which run

When the run breaks after output (`edge.fleet.continuation`: its stream broke
or was reset, its node went away, was drained, or failed) and the answer may
move (`Mover.move`): the request is within its total deadline, it has
`[routing] migrations` left, the answer so far is within what a continuation
carries, and another node (not tried yet, or restarted since: `Tried`; up,
admitting runs) whose model
says `continuation` has a slot for it, then a run on that node continues the
answer: the request's RunRequest with `continuation` (the text and reasoning
text its earlier runs sent, every event in order, and their output tokens),
serialized off the loop, under the same run id, deadline and session. The
session goes on with the new run's events as if nothing happened: its one
role chunk was written, its filters (held tool-call text, think blocks,
logprob tracking) keep their state, and its one terminal is the new run's.

Output for the caller: a stream migrates once it has written output beyond
the role chunk (before, failover restarts it on another node, exactly, as
before the commit point); a non-streaming answer once any output came: it
continues rather than restarts (the work done is kept; the text is the
model's own either way), and falls back on failover's restart when it cannot
move. An answer whose head went out with a keep-alive before any output (its
commit point) and whose stream then broke (its node gone, its stream reset;
not an error event, which is the node's answer) has nothing to continue: it
starts again on another node (any node serving the model, continuation or
not), counted as a migration. A continuation whose start failed with
nothing running (`Run.nothing_runs`: its node unreachable, its call ended
before the node accepted, or its RunRequest never written) is tried on
another node not tried yet, within the same migration and deadline.

The broken run ends as broken runs do (its outcome `stream_broken` or
`error_event`, its slot back, its verdict to its breaker by the same rule:
a failure after output is not counted), once its read task is over: a run
is never live on two nodes (the node got its CancelRun when the stream
broke, through the one cancel path). Its outcome is not the request's: the
continuation is adopted, and its usage is the answer's: the continuing node
counts the output tokens it is told the earlier runs took in its own (the
contract's `Continuation.output_tokens`), and input tokens are summed as
each node reported them (a broken run reports none, unless its error event
did). An answer that cannot move
ends as it did before migration: an error frame. Each break after output is
logged (a warning), counted (`iop_edge_migrations_total{reason,outcome}`)
and recorded on the request's span; the gap from the break to the
continuation's first event is `iop_edge_migration_gap_seconds`.

Never migrated: a client that left, a timeout, a slow reader, this edge's
drain (ends the edge chose: their runs have a cause), the request's own
fault (a refusal) or an overload (a 429 after output), an answer past the
edge's own limits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio
from loguru import logger

from edge.api.request import ChatRequest
from edge.contract.routes import MAX_MESSAGE_BYTES
from edge.errors import EdgeError
from edge.fleet.answer import Answer, Mark
from edge.fleet.continuation import Break, Delivered, why_not
from edge.fleet.nodestate import NodeState, Tried
from edge.fleet.run import Run
from edge.fleet.runs import RunPlan, Runs
from edge.node.client import CANCEL_QUEUE_S, CANCEL_RPC_TIMEOUT_S
from edge.node.wire import PreparedRunRequest

# How long a run's read task (its CancelRun included) may take before its request gives
# up on another node (a retry, a migration): the node may still run it (the read task
# bounds it by these two already).
CANCEL_WAIT_S = CANCEL_QUEUE_S + CANCEL_RPC_TIMEOUT_S + 1.0


@dataclass(slots=True, eq=False)
class Mover:
    """One request's way to move its answer (see the module doc): what a continuation
    run needs, the nodes the request tried, and the migrations it has left."""

    runs: Runs
    answer: Answer
    # What every run of the request starts from (its request, RunRequest, deadline...).
    plan: RunPlan
    left: int
    tried: Tried = field(default_factory=Tried)

    @property
    def request(self) -> ChatRequest:
        return self.plan.request

    @property
    def payload(self) -> PreparedRunRequest:
        return self.plan.payload

    @property
    def deadline(self) -> float:
        return self.plan.deadline

    def track(self, run: Run) -> None:
        """Keep `run`'s answer so far (its events tapped), when it may move: migrations
        left. Bounded by what a continuation can carry and by the session's cap on an
        answer held whole; reserved from the memory budget as it grows."""
        if self.left <= 0:
            return
        cap = min(run.session.settings.max_held_chars, MAX_MESSAGE_BYTES - len(self.payload))
        run.reader.delivered = Delivered(cap, self._reserve)

    def _reserve(self, chars: int) -> bool:
        """Room in the memory budget for `chars` more characters kept (about a byte
        each), given back when the request ends; False: the budget has none."""
        give_back = self.runs.admission.try_hold(chars)
        if give_back is None:
            return False
        self.answer.at_end(give_back)
        return True

    def resumed(self, gap_s: float) -> None:
        """The moved answer's first event came `gap_s` after its break."""
        self.runs.metrics.migration_gap.observe(gap_s)

    async def move(self, answer: Answer) -> bool:
        """Continue `answer`'s broken run on another node; False: it does not move
        (the caller ends it as the break would have). Counted and logged either way."""
        old = answer.leg
        assert old is not None
        brk, delivered = old.reader.broke, old.reader.delivered
        assert brk is not None
        assert delivered is not None
        broke_at = trio.current_time()
        target = await self._target(old, brk, delivered, broke_at)
        if target is None:
            return False
        payload, node = target
        # From here the answer is the continuation's: the broken run ends as broken
        # runs do (slot, verdict), without counting as the request's outcome.
        old.hand_over()
        self.left -= 1
        tokens = delivered.moved()
        new = await self._continuation(answer, old, brk, delivered, payload, node)
        if new is None:
            return False
        self._adopt(new)
        answer.leg = new
        answer.gap_from = broke_at
        self._count(brk.reason, "migrated")
        logger.bind(
            request_id=old.info.request_id, run_id=old.info.run_id, from_node=old.info.node,
            to_node=new.info.node, reason=brk.reason, delivered_chars=delivered.chars,
            output_tokens=tokens,
        ).warning("run {} broke on node {} after {} characters ({}); it continues on node {}",
                  old.info.run_id, old.info.node, delivered.chars, brk.reason,
                  new.info.node)  # fmt: skip
        return True

    async def _target(
        self, old: Run, brk: Break, delivered: Delivered, broke_at: float
    ) -> tuple[PreparedRunRequest, NodeState] | None:
        """What the continuation of `old`'s answer sends, and the node it goes to (its slot
        taken); None: the answer does not move (counted and logged)."""
        handle = old.reader.handle
        assert handle is not None
        why = why_not(
            migrations_left=self.left, now=broke_at, deadline=self.deadline,
            gone=delivered.gone,
        )  # fmt: skip
        if why is None:
            # The broken run's read task ends on its own (the node ended the run, or its
            # stream broke and the CancelRun is on its way): never live on two nodes.
            with trio.move_on_at(min(broke_at + CANCEL_WAIT_S, self.deadline)):
                await handle.done.wait()
            if not handle.done.is_set():
                why = "expired"
        payload = None
        if why is None:
            # Nothing came yet (the head went out with a keep-alive): the run starts again
            # on another node, as failover would have before the head, on any node.
            payload = await self._continued(delivered) if delivered.output else self.payload
            if payload is None:
                why = "too_long"
        node = None
        if why is None:
            if (was := old.node) is not None:
                self.tried.add(was, old.life)  # the life it reached: see `Tried`
            node = await self._node(continues=delivered.output)
            if node is None:
                why = "no_node"
        if why is not None or old.session.terminated:
            if node is not None:
                self.runs.admission.release(node)
            if why is not None:
                self._refused(old, brk, why, delivered.chars)
            return None
        assert payload is not None
        assert node is not None
        return payload, node

    async def _continuation(
        self,
        answer: Answer,
        old: Run,
        brk: Break,
        delivered: Delivered,
        payload: PreparedRunRequest,
        node: NodeState,
    ) -> Run | None:
        """The run that continues `old`'s answer on `node`, started (on another node when
        nothing runs on one whose start failed); None: none started (counted, logged)."""
        session = old.session
        while True:
            new = self.runs.open(node, answer.nursery, self.plan, session, payload=payload)
            new.reader.output_seen = True
            new.reader.delivered = delivered
            answer.journal.append(Mark(
                "migrated", trio.current_time(), old.info.node, brk.reason, new.info.node,
                chars=delivered.chars,
            ))  # fmt: skip
            try:
                await answer.hold(new)
                return new
            except EdgeError as exc:
                failed = exc
            # Its start failed: when nothing runs there (`Run.nothing_runs`; the node may
            # have died since the pool last heard of it), another node may take the
            # continuation. Else the answer ends there: a run is never live on two nodes.
            self.tried.add(node, new.life)  # None: no process of it saw the run
            retry = None
            if new.nothing_runs and not session.terminated:
                retry = await self._node(continues=delivered.output)
            if retry is None:
                self._adopt(old)  # the request's outcome: the break's
                # Stopped by the request's deadline (no accept before it), or a failure.
                outcome = "expired" if trio.current_time() >= self.deadline else "failed"
                self._count(brk.reason, outcome)
                logger.bind(
                    request_id=old.info.request_id, run_id=old.info.run_id,
                    from_node=old.info.node, to_node=new.info.node, reason=brk.reason,
                    delivered_chars=delivered.chars, outcome=outcome,
                ).warning("run {} broke on node {} after {} characters ({}); its continuation"
                          " did not start on node {}: {}", old.info.run_id, old.info.node,
                          delivered.chars, brk.reason, new.info.node, failed.type)  # fmt: skip
                return None
            logger.bind(
                request_id=old.info.request_id, run_id=old.info.run_id, from_node=new.info.node,
                to_node=retry.client.name, error_type=failed.type,
            ).warning("the continuation of run {} did not start on node {} ({}); it tries"
                      " node {}", old.info.run_id, new.info.node, failed.type,
                      retry.client.name)  # fmt: skip
            node = retry

    def _adopt(self, run: Run) -> None:
        """`run` answers a stream from here: its outcome is the request's. Not for a
        non-streaming answer: nothing of it was sent, and failover, which still decides
        whether to start it again elsewhere, adopts the run that answers it."""
        if self.request.stream:
            self.answer.adopt(run)

    async def _continued(self, delivered: Delivered) -> PreparedRunRequest | None:
        """The request's RunRequest continuing the answer so far, built off the loop;
        None: too long to send."""
        text, reasoning = delivered.parts()
        tokens = delivered.output_tokens

        def build() -> PreparedRunRequest | None:
            try:
                return self.payload.continued("".join(text), "".join(reasoning), tokens)
            except EdgeError:
                return None

        return await trio.to_thread.run_sync(build)

    async def _node(self, *, continues: bool) -> NodeState | None:
        """Another node for the continuation, its slot taken: not tried, up, and able to
        continue the model (`continues`: there is an answer so far to continue); queued
        first (bounded by the request's deadline). None: none."""
        model = self.request.model
        tried = self.tried
        excluded = [
            s for s in self.runs.pool.nodes
            if s in tried or not s.health.up
            or (continues and model not in s.continuation_models)
        ]  # fmt: skip
        with trio.move_on_at(self.deadline):
            try:
                return await self.runs.admission.acquire(
                    model, logprobs=self.request.logprobs, exclude=excluded,
                    affinity_key=self.plan.affinity_key, route=self.plan.route, first=True,
                    tenant=self.plan.tenant, tier=self.plan.tier,
                )  # fmt: skip
            except EdgeError:
                return None
        return None

    def _refused(self, old: Run, brk: Break, why: str, chars: int) -> None:
        self._count(brk.reason, why)
        logger.bind(
            request_id=old.info.request_id, run_id=old.info.run_id, from_node=old.info.node,
            reason=brk.reason, delivered_chars=chars, outcome=why,
        ).warning("run {} broke on node {} after {} characters ({}); it cannot continue"
                  " elsewhere ({})", old.info.run_id, old.info.node, chars, brk.reason,
                  why)  # fmt: skip

    def _count(self, reason: str, outcome: str) -> None:
        self.runs.metrics.migrations.labels(reason, outcome).inc()
