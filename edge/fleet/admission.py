"""Admission: node slots, and the one bounded FIFO of requests waiting for one.

A run needs a slot on its node (`NodeState.in_flight` under `max_runs`).
`Admission.acquire` takes one: at once when the pool picks a node with a
free slot, else by waiting in the queue. The queue is one FIFO for the
whole edge, bounded in length (`[admission] max_queue`) and in time
(`queue_timeout_s`); past either bound the request is shed at once with
`OverloadedError` (503, `Retry-After`), before any byte of its answer.

A slot is handed over, never raced for: when one is given back (`release`)
or the pool says a node may take runs again (`NodePool.on_available`),
`dispatch` looks at the waiters from the head, lets the pool pick for each
and, on the first pick that finds a node, takes the slot for that waiter
and wakes it alone. A waiter whose model has no free node keeps its place
(the ones behind it that can run are not held up by it). The work per
dispatch is bounded: at most SCAN waiters are looked at, and a pick that
found no slot is not repeated for the same model in that pass. A request
that leaves while queued (its client gone) leaves the queue; a slot handed
to it in that instant is given back.

The memory budget: the requests queued and running hold their parsed form
(and body) all that time, and a small body can parse into twenty times its
size in objects. `hold` takes a request's estimated bytes (`edge.api.footprint`)
before it is queued, against `memory_budget_bytes` for the whole edge (each
worker process its own); a request that would pass it is shed at once like
a full queue (503 `overloaded`, Retry-After), one that could never fit is a
413. The bytes go back through the call `hold` returns, once, however the
request ends (its scope calls it at the end of the request's cycle).

This module knows nothing of HTTP or of runs: only the pool, its slots,
the budget's bytes and the clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from itertools import islice

import trio
from loguru import logger

from edge.config import AdmissionConfig
from edge.errors import EdgeError, OverloadedError, PayloadTooLargeError
from edge.fleet.affinity import SessionKey
from edge.fleet.cacheaware import Route
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.observe.metrics import EdgeMetrics

# Waiters looked at per dispatch, from the head of the queue.
SCAN = 32
# The Retry-After of a shed answer, in seconds.
RETRY_AFTER_S = 1
MiB = 1024 * 1024


@dataclass(slots=True, eq=False)
class _Waiter:
    """One queued request: what it needs, and what it was handed."""

    model: str
    logprobs: bool
    exclude: Collection[NodeState]
    affinity_key: SessionKey | None
    route: Route | None
    woken: trio.Event = field(default_factory=trio.Event)
    node: NodeState | None = None  # its slot is taken
    error: EdgeError | None = None  # the pool's answer: no node can serve it at all


class Admission:
    """The node slots of one edge and the queue of requests waiting for one."""

    def __init__(self, pool: NodePool, config: AdmissionConfig, metrics: EdgeMetrics) -> None:
        self._pool = pool
        self._config = config
        self._metrics = metrics
        self._waiters: deque[_Waiter] = deque()
        self._shed_unlogged = 0
        self._shed_logged_at = -math.inf
        self._held = 0  # bytes of the memory budget taken (`hold`)
        pool.on_available = self.dispatch

    def configure(self, config: AdmissionConfig) -> None:
        """A reload's `[admission]`: the queue's bounds and the memory budget from the next
        request on (a request queued keeps the timeout it was queued with; the bytes held
        stay held, and a budget lowered below them sheds new requests until they go)."""
        self._config = config
        self.dispatch()

    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return len(self._waiters)

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
        gauge = self._metrics.request_memory
        gauge.set(self._held)
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self._held -= nbytes
                gauge.set(self._held)

        return give_back

    def try_hold(self, nbytes: int) -> Callable[[], None] | None:
        """`hold`, for what a running request keeps as it goes (an answer so far, for
        its migration): None when the budget has not that much left (nothing shed)."""
        if self._held + nbytes > self._config.memory_budget_bytes:
            return None
        return self.hold(nbytes)

    def shed_if_full(self) -> None:
        """Shed a request before it is parsed when the queue is full and no node has a
        free slot: whatever its model, it could only queue. Answering before the parse
        (milliseconds, in a worker thread behind other parses) keeps a shed answer fast
        when shedding matters most."""
        if (error := self.shed_now()) is not None:
            raise error

    def shed_now(self) -> OverloadedError | None:
        """The error a new request gets at once (counted and logged as shed), or None
        when it could be queued or served (see `shed_if_full`)."""
        if len(self._waiters) >= self._config.max_queue and not any(
            state.has_slot() for state in self._pool.nodes
        ):
            return self._shed_full()
        return None

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
    ) -> NodeState:
        """A node for `model` with a slot taken for the caller (give it back with `release`).

        Raises what the pool raises when no node can serve the model at all
        (NotFoundError, RequestError, NodeUnavailableError), and
        OverloadedError when the queue is full or the wait passed
        `queue_timeout_s`. `route` is the request's prefix blocks, for the
        cache-aware policy (`NodePool.pick`). `first` queues at the head (a retry of a request
        that already waited its turn). `on_queue` hears the (trio) time the
        request joined the queue, if it had to.
        """
        pool = self._pool
        if self._waiters:
            self.dispatch()  # a slot free now goes to those who waited first
        node = pool.pick(
            model, logprobs=logprobs, exclude=exclude, affinity_key=affinity_key, route=route
        )
        if node is not None:
            node.in_flight += 1
            return node
        if len(self._waiters) >= self._config.max_queue:
            raise self._shed_full()
        waiter = _Waiter(model, logprobs, exclude, affinity_key, route)
        if first:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        self._metrics.queue_depth.set(len(self._waiters))
        queued_at = trio.current_time()
        if on_queue is not None:
            on_queue(queued_at)
        returned = False
        try:
            with trio.move_on_after(self._config.queue_timeout_s):
                await waiter.woken.wait()
            returned = True
        finally:
            self._metrics.queue_seconds.observe(trio.current_time() - queued_at)
            if waiter.node is None and waiter.error is None:
                self._waiters.remove(waiter)  # still queued: it leaves (timeout, client gone)
                self._metrics.queue_depth.set(len(self._waiters))
            elif not returned and waiter.node is not None:
                self.release(waiter.node)  # handed a slot as its client left
        if waiter.error is not None:
            raise waiter.error
        if waiter.node is None:
            raise self._shed(
                "queue_timeout",
                f"no node slot was free within {self._config.queue_timeout_s:g}s",
            )
        return waiter.node

    def release(self, node: NodeState) -> None:
        """Give back a slot taken by `acquire`; the next waiter that can use it gets it."""
        node.in_flight -= 1
        if self._waiters:
            self.dispatch()

    def dispatch(self) -> None:
        """Hand free slots to waiters, in queue order (bounded work, see the module doc)."""
        waiters = self._waiters
        if not waiters:
            return
        pick = self._pool.pick
        full: set[tuple[str, bool]] = set()  # picks that found no slot in this pass
        handed: list[_Waiter] = []
        # A copy of the head: the loop hands some of them out.
        for waiter in list(islice(waiters, SCAN)):
            key = (waiter.model, waiter.logprobs)
            routed = waiter.route is not None and self._pool.picker.cache_aware
            plain = not waiter.exclude and waiter.affinity_key is None and not routed
            if plain and key in full:
                continue
            try:
                node = pick(
                    waiter.model, logprobs=waiter.logprobs, exclude=waiter.exclude,
                    affinity_key=waiter.affinity_key, route=waiter.route,
                )  # fmt: skip
            except EdgeError as exc:  # nothing can serve it any more: it is told why
                waiter.error = exc
            else:
                if node is None:
                    if plain:
                        full.add(key)
                    continue
                node.in_flight += 1
                waiter.node = node
            handed.append(waiter)
        for waiter in handed:
            if waiters[0] is waiter:
                waiters.popleft()
            else:
                waiters.remove(waiter)
            waiter.woken.set()
        if handed:
            self._metrics.queue_depth.set(len(waiters))

    def _shed_full(self) -> OverloadedError:
        return self._shed("queue_full", f"all node slots are taken and {self.depth} requests wait")

    def _shed(self, reason: str, why: str) -> OverloadedError:
        self._metrics.shed.labels(reason).inc()
        # Shedding comes in bursts: one line a second at most, with the count.
        self._shed_unlogged += 1
        now = trio.current_time()
        if now - self._shed_logged_at >= 1.0:
            logger.bind(reason=reason).warning(
                "shed {} request(s) with 503 overloaded, last: {}", self._shed_unlogged, why
            )
            self._shed_unlogged = 0
            self._shed_logged_at = now
        return OverloadedError(
            f"The edge is overloaded ({why}); retry after {RETRY_AFTER_S}s.",
            retry_after_s=RETRY_AFTER_S,
        )
