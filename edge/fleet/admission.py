"""Admission: node slots, and the bounded queue of requests waiting for one.

A run needs a slot on its node (`NodeState.in_flight` under `max_runs`).
`Admission.acquire` takes one: at once when the pool picks a node with a
free slot, else by waiting in the queue. The queue is bounded in length for
the whole edge (`[admission] max_queue`), per tenant (`max_queue_per_key`,
policy "fair") and in time (`queue_timeout_s`); past a bound a request is shed
before any byte of its answer: `OverloadedError` (503, `Retry-After`), or for a
flex request `FlexUnavailableError` (429 `rate_limit_exceeded`, `Retry-After`,
as OpenAI answers flex when capacity is short). Which request is shed, and in
which order the waiting are served, is the queue's (`edge.fleet.queues`: per
tenant and tier under "fair", arrival order under "fifo"); a request already
waiting that is shed for a newcomer is woken with its error.

A slot is handed over, never raced for: when one is given back (`release`)
or the pool says a node may take runs again (`NodePool.on_available`),
`dispatch` lets the queue offer its waiters in turn, lets the pool pick for
each and, on the first pick that finds a node, takes the slot for that waiter
and wakes it alone. A waiter whose model has no free node keeps its turn
(the ones that can run are not held up by it), and so does one that passes up the
free slot, for a bounded time, to wait for a busy node holding much more of its
prompt (cache_aware: `edge.fleet.cachehold`, which also decides whether a new
request waits so rather than take a free slot). The work per dispatch is
bounded (`edge.fleet.queues.SCAN`), and a pick that found no slot is not
repeated for the same model in that pass. A request that leaves while queued
(its client gone) leaves the queue; a slot handed to it in that instant is
given back.

Slots kept for priority (`[admission] priority_slots`, 0: none): a default or flex
request is not given a slot when that would leave fewer than `priority_slots` free
on the nodes that are up (the whole fleet, as this process counts its slots), so that
many priority requests find one at once; a priority request takes any free slot. Under
"fair" a default request kept waiting ends the dispatch pass (no priority request
waits behind it); under "fifo" it keeps its place and the priority requests among the
first SCAN waiting take the kept slots. With several models the kept slots are
wherever slots are free: a priority request finds one at once only on a node that
serves its model.

The memory budget: the requests queued and running hold their parsed form
(and body) all that time, and a small body can parse into twenty times its
size in objects. `hold` takes a request's estimated bytes (`edge.api.footprint`)
before it is queued, against `memory_budget_bytes` for the whole edge (each
worker process its own); a request that would pass it is shed at once like
a full queue (503 `overloaded`, Retry-After), one that could never fit is a
413. The bytes go back through the call `hold` returns, once, however the
request ends (its scope calls it at the end of the request's cycle).

Before a request is parsed (`shed_if_full`), it is shed when the queue would shed
it whatever it asks: under "fifo" when the queue is full; under "fair" when it
would go even at the most urgent tier its key may use (so only once its tenant is
known: the HTTP server, which knows no key, sheds nothing early under "fair").

This module knows nothing of HTTP or of runs: only the pool, its slots,
the budget's bytes and the clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

import trio
from loguru import logger

from edge.config import AdmissionConfig
from edge.errors import EdgeError, FlexUnavailableError, OverloadedError, PayloadTooLargeError
from edge.fleet import cachehold
from edge.fleet.affinity import SessionKey
from edge.fleet.cacheaware import Route
from edge.fleet.cachehold import Holds
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.fleet.queues import SCAN, FairQueue, FifoQueue, Waiter
from edge.fleet.tenants import Tenant
from edge.observe.metrics import UNKNOWN_TIER, EdgeMetrics

__all__ = ["RETRY_AFTER_S", "SCAN", "Admission"]

# The Retry-After of a shed answer, in seconds.
RETRY_AFTER_S = 1
MiB = 1024 * 1024


def _queue(policy: str) -> FairQueue | FifoQueue:
    return FifoQueue() if policy == "fifo" else FairQueue()


def _why(reason: str, queue: FairQueue | FifoQueue, waiter: Waiter) -> str:
    """Why a request is shed from a full queue, for its message."""
    if reason == "key_full":
        n = queue.queued(waiter.tenant_name)
        return f"all node slots are taken and {n} requests of this key or client wait"
    return f"all node slots are taken and {len(queue)} requests wait"


def _kept(pool: NodePool, kept: int, tier: str, model: str, logprobs: bool) -> bool:
    """Whether a request of `tier` must wait, leaving the `kept` free slots
    (`priority_slots`) to priority requests: a default or flex one does when no more
    than `kept` slots are free on the nodes that are up. One that no node could serve
    is not kept waiting: its pick says why."""
    if not kept or tier == "priority":
        return False
    free = 0.0
    serves = False
    for state in pool.nodes:
        if model in state.models and (not logprobs or model in state.logprobs_models):
            serves = True
        if state.health.up and state.has_slot():
            free += state.max_runs - state.in_flight
    return serves and free <= kept


def _room(queue: FairQueue | FifoQueue, config: AdmissionConfig, waiter: Waiter) -> bool:
    """Whether `waiter` would join the queue with no one shed for it (itself included)."""
    return queue.shed_for(waiter, config.max_queue, config.key_max_queue) is None


class Admission:
    """The node slots of one edge and the queue of requests waiting for one."""

    def __init__(self, pool: NodePool, config: AdmissionConfig, metrics: EdgeMetrics) -> None:
        self._pool = pool
        self._config = config
        self._metrics = metrics
        self._queue = _queue(config.policy)
        self._shed_unlogged = 0
        self._shed_logged_at = -math.inf
        self._held = 0  # bytes of the memory budget taken (`hold`)
        metrics.watch_request_memory(lambda: self._held)
        self._holds = Holds(pool, metrics.cache_held)
        pool.on_available = self.dispatch

    def configure(self, config: AdmissionConfig) -> None:
        """A reload's `[admission]`: the queue's bounds, its policy and the memory budget
        from the next request on (a request queued keeps the timeout it was queued with;
        when the policy changes, the requests waiting join the new queue in the old one's
        order; the bytes held stay held, and a budget lowered below them sheds new
        requests until they go)."""
        if config.policy != self._config.policy:
            queue = _queue(config.policy)
            for waiter in self._queue:
                queue.push(waiter)
            self._queue = queue
        self._config = config
        self.dispatch()

    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return len(self._queue)

    def report(self) -> dict[str, object]:
        """The queue as `/readyz` shows it: its policy, and the requests waiting now per
        service tier (every tier named)."""
        return {"policy": self._config.policy, "depth": self.depth, **self._queue.by_tier()}

    @property
    def held(self) -> int:
        """Bytes of the memory budget the requests queued and running hold now."""
        return self._held

    def hold(self, nbytes: int) -> Callable[[], None]:
        """Take `nbytes` of the memory budget for a request; returns the call that gives
        them back (the first call does, later ones do nothing).

        Raises OverloadedError (503, Retry-After) when the budget has not that much
        left, PayloadTooLargeError (413) when the whole budget is less.
        """
        budget = self._config.memory_budget_bytes
        if nbytes > budget:
            raise PayloadTooLargeError(
                f"The request would hold {nbytes / MiB:.1f} MiB of memory once parsed, more "
                f"than the edge's whole budget of {budget / MiB:.0f} MiB for requests; send "
                "fewer or larger content parts, or a smaller body.",
                code="payload_too_large",
            )
        if self._held + nbytes > budget:
            raise self._shed(
                "memory_budget",
                f"queued and running requests hold {self._held / MiB:.0f} MiB of its "
                f"{budget / MiB:.0f} MiB memory budget; this one needs {nbytes / MiB:.1f} MiB",
            )
        self._held += nbytes
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self._held -= nbytes

        return give_back

    def try_hold(self, nbytes: int) -> Callable[[], None] | None:
        """`hold`, for what a running request keeps as it goes (an answer so far, for
        its migration): None when the budget has not that much left (nothing shed)."""
        if self._held + nbytes > self._config.memory_budget_bytes:
            return None
        return self.hold(nbytes)

    def shed_if_full(self, tenant: Tenant | None = None) -> None:
        """Shed a request before it is parsed when it could only queue, and the queue would
        shed it whatever it asks (see the module doc); `tenant`: whose it is, when known.
        Answering before the parse (milliseconds, in a worker thread behind other
        parses) keeps a shed answer fast when shedding matters most."""
        if (error := self.shed_now(tenant)) is not None:
            raise error

    def shed_now(self, tenant: Tenant | None = None) -> OverloadedError | None:
        """The error a new request of `tenant` gets at once (counted and logged as shed),
        or None when it could be queued or served (see `shed_if_full`)."""
        queue = self._queue
        if len(queue) < min(self._config.max_queue, self._config.key_max_queue):
            return None
        if tenant is None and isinstance(queue, FairQueue):
            return None  # whom a fair queue sheds depends on whose the request is
        probe = Waiter("", False, (), None, None, tenant, tenant.top if tenant else "default")
        shed = queue.shed_for(probe, self._config.max_queue, self._config.key_max_queue)
        if shed is None or shed[0] is not probe:
            return None
        if any(state.has_slot() for state in self._pool.nodes):
            return None
        return self._shed(shed[1], _why(shed[1], queue, probe), probe, tier=UNKNOWN_TIER)

    async def acquire(
        self,
        model: str,
        *,
        logprobs: bool = False,
        exclude: Collection[NodeState] = (),
        affinity_key: SessionKey | None = None,
        route: Route | None = None,
        first: bool = False,
        on_queue: Callable[[float], object] | None = None,
        tenant: Tenant | None = None,
        tier: str = "default",
    ) -> NodeState:
        """A node for `model` with a slot taken for the caller (give it back with `release`).

        Raises what the pool raises when no node can serve the model at all
        (NotFoundError, RequestError, NodeUnavailableError), and
        OverloadedError (FlexUnavailableError for a flex request) when the queue sheds
        it or the wait passed `queue_timeout_s`. `route` is the request's prefix blocks,
        for the cache-aware policy (`NodePool.pick`). `first` queues at the head of its
        tenant's queue (a retry of a request that already waited its turn). `on_queue`
        hears the (trio) time the request joined the queue, if it had to. `tenant` and
        `tier`: whose the request is and the service tier it runs on (its queue, band and
        share; None: the whole edge's bound only).
        """
        pool = self._pool
        if len(self._queue):
            self.dispatch()  # a slot free now goes to those who waited first
        node = None
        waiter = Waiter(model, logprobs, exclude, affinity_key, route, tenant, tier)
        waiter.hold_over = first  # a retry waited its turn already: it holds no slot out
        if not _kept(pool, self._config.priority_slots, tier, model, logprobs) and not (
            _room(self._queue, self._config, waiter) and self._holds.passes(waiter)
        ):
            node = pool.pick(
                model, logprobs=logprobs, exclude=exclude, affinity_key=affinity_key, route=route
            )
        if node is not None:
            node.in_flight += 1
            return node
        try:
            self._join(waiter, first=first)
        except EdgeError:
            self._holds.ended(waiter, "left")
            raise
        queued_at = trio.current_time()
        if on_queue is not None:
            on_queue(queued_at)
        returned = False
        try:
            with trio.move_on_after(self._config.queue_timeout_s):
                await self._holds.wait(waiter, self.dispatch)
            returned = True
        finally:
            self._holds.ended(waiter, "left")  # unless served (counted when handed)
            waited = trio.current_time() - queued_at
            self._metrics.queue_seconds.observe(waited)
            self._metrics.queue_wait.labels(tier).observe(waited)
            if waiter.node is None and waiter.error is None:
                self._queue.remove(waiter)  # still queued: it leaves (timeout, client gone)
                self._gauges(waiter)
            elif not returned and waiter.node is not None:
                self.release(waiter.node)  # handed a slot as its client left
        if waiter.error is not None:
            raise waiter.error
        if waiter.node is None:
            why = f"no node slot was free within {self._config.queue_timeout_s:g}s"
            raise self._shed("queue_timeout", why, waiter)
        return waiter.node

    def release(self, node: NodeState) -> None:
        """Give back a slot taken by `acquire`; the next waiter that can use it gets it."""
        cachehold.slot_freed(node, trio.current_time())
        node.in_flight -= 1
        if len(self._queue):
            self.dispatch()

    def dispatch(self) -> None:
        """Hand free slots to waiters, in the queue's order (bounded work, see the module
        doc)."""
        queue = self._queue
        if not len(queue):
            return
        pool = self._pool
        cache_aware = pool.picker.cache_aware
        full: set[tuple[str, bool]] = set()  # picks that found no slot in this pass
        kept = self._config.priority_slots
        banded = isinstance(queue, FairQueue)  # no priority request waits behind this one
        holds = self._holds
        waiting: dict[NodeState, int] = {}  # who passed up a slot in this pass, for which node

        def hand(waiter: Waiter) -> bool | None:
            if _kept(pool, kept, waiter.tier, waiter.model, waiter.logprobs):
                return None if banded else False
            if holds.passes(waiter, waiting):
                return False  # it keeps its turn, for the node it waits for
            key = (waiter.model, waiter.logprobs)
            routed = waiter.route is not None and cache_aware
            plain = not waiter.exclude and waiter.affinity_key is None and not routed
            if plain and key in full:
                return False
            try:
                node = pool.pick(
                    waiter.model, logprobs=waiter.logprobs, exclude=waiter.exclude,
                    affinity_key=waiter.affinity_key, route=waiter.route,
                )  # fmt: skip
            except EdgeError as exc:  # nothing can serve it any more: it is told why
                waiter.error = exc
                return True
            if node is None:
                if not any(state.has_slot() for state in pool.nodes):
                    return None  # no slot anywhere: the pass is over
                if plain:
                    full.add(key)
                return False
            node.in_flight += 1
            waiter.node = node
            holds.ended(waiter, "served")
            return True

        for waiter in queue.dispatch(hand):
            waiter.woken.set()
            self._gauges(waiter)

    def _join(self, waiter: Waiter, *, first: bool) -> None:
        """Queue `waiter`, shedding whom the queue says must go for it (raises when that
        is `waiter` itself; another is woken with its error)."""
        queue = self._queue
        config = self._config
        shed = queue.shed_for(waiter, config.max_queue, config.key_max_queue)
        if shed is not None:
            victim, reason = shed
            error = self._shed(reason, _why(reason, queue, victim), victim)
            if victim is waiter:
                raise error
            queue.remove(victim)
            victim.error = error
            victim.woken.set()
            self._gauges(victim)
        queue.push(waiter, first=first)
        self._gauges(waiter)

    def _gauges(self, waiter: Waiter) -> None:
        """The queue's gauges after `waiter` joined or left: its tier's depth, and its
        key's requests waiting when it is a named key."""
        metrics = self._metrics
        metrics.queue_depth.labels(waiter.tier).set(self._queue.by_tier()[waiter.tier])
        tenant = waiter.tenant
        if tenant is not None and tenant.named:
            metrics.key_queued.labels(tenant.name).set(self._queue.queued(tenant.name))

    def _shed(
        self, reason: str, why: str, waiter: Waiter | None = None, *, tier: str | None = None
    ) -> OverloadedError:
        """Count, log and return the error of a request shed for `reason` (`waiter`: the
        request, when queued or about to be; `tier`: the label, else the waiter's)."""
        tier = tier or (waiter.tier if waiter is not None else UNKNOWN_TIER)
        self._metrics.shed.labels(reason, tier).inc()
        # Shedding comes in bursts: one line a second at most, with the count (each
        # request's own line names its key and tier).
        self._shed_unlogged += 1
        now = trio.current_time()
        if now - self._shed_logged_at >= 1.0:
            key = waiter.tenant_name if waiter is not None else ""
            logger.bind(reason=reason, key=key, tier=tier).warning(
                "shed {} request(s), last: {} (key {!r}, tier {})",
                self._shed_unlogged, why, key, tier,
            )  # fmt: skip
            self._shed_unlogged = 0
            self._shed_logged_at = now
        if waiter is not None and waiter.tier == "flex":
            return FlexUnavailableError(
                f"Flex processing is not available right now ({why}); retry after"
                f" {RETRY_AFTER_S}s, or use the default tier.",
                retry_after_s=RETRY_AFTER_S,
            )
        return OverloadedError(
            f"The edge is overloaded ({why}); retry after {RETRY_AFTER_S}s.",
            retry_after_s=RETRY_AFTER_S,
        )
