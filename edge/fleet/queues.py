"""The requests waiting for a node slot, in the order slots are handed to them.

Two orders, one per `[admission] policy`, behind the same calls: `push` (at the back;
at the front for a retry, which waited its turn already), `remove` (a request that
left), `dispatch` (hand free slots: `hand(waiter)` tries one and says whether it is
done with), and `shed_for` (whom to shed, if anyone, when one more would join).

`FifoQueue` ("fifo"): one queue in arrival order for every request, tenants and tiers
aside; full, the newcomer is shed.

`FairQueue` ("fair"): a band per service tier, served strictly (priority, then
default, then flex: `edge.fleet.tenants`); in a band, a queue per tenant (a flow), FIFO
within it, the flows served by start-time fair queueing (virtual time): a flow that
starts waiting takes the band's virtual time as its tag (or the tag its last request
finished at, when later), the flow with the smallest tag is served next, and serving
one of its requests moves its tag on by 1 / its tenant's weight. So the tenants with
requests waiting get slots in proportion to their weights, one with a single request
waiting is served within one round of the others, and dispatch costs O(log flows).

A request that cannot run yet (its model's nodes are full, the node its session is
tied to is busy, the nodes it may use are excluded), or that passes up the slot free
to wait for a node holding more of its prompt (`edge.fleet.cachehold`), does not hold
up the others: its flow is set aside for the pass with its tag unchanged, so it keeps
its turn for the next slot it takes, while flows behind it take the slots they can
(in its flow, the requests behind it; under "fifo", those behind it in the queue). A flow whose
turn came while it was set aside gets one turn of it back, not credit for the whole
wait: after it is served, its tag is at least the band's virtual time.

Shedding, when one more would join: past `max_queue_per_key` for its tenant, that
tenant's newest request of its least urgent band goes (the newcomer itself when it is
in that band); past `max_queue` for the edge, the least urgent band that has requests
sheds (flex, then default, priority only when nothing else is left), and in it the
tenant with the most waiting for its weight loses its newest (the newcomer's tenant
on a tie: a newcomer never displaces an equal).

Bounded work per dispatch: at most SCAN requests of one flow and LOOKS in all are
looked at, and the pass ends once no slot is left for anyone. Pure bookkeeping: no
clock, no I/O.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from itertools import count, islice

import trio

from edge.errors import EdgeError
from edge.fleet.affinity import SessionKey
from edge.fleet.cacheaware import Route
from edge.fleet.nodestate import NodeState
from edge.fleet.tenants import SERVICE_TIERS, Tenant, band

# Requests of one flow (or of the FIFO's head) looked at per dispatch.
SCAN = 32
# Requests looked at per dispatch in all, over the flows of every band.
LOOKS = 4 * SCAN
# Idle flows kept (for their tags) before a sweep forgets the ones with no credit left.
_IDLE_KEPT = 1024


@dataclass(slots=True, eq=False)
class Waiter:
    """One queued request: what it needs, whose it is, and what it was handed."""

    model: str
    logprobs: bool
    exclude: Collection[NodeState]
    affinity_key: SessionKey | None
    route: Route | None
    tenant: Tenant | None = None
    tier: str = "default"
    woken: trio.Event = field(default_factory=trio.Event)
    node: NodeState | None = None  # its slot is taken
    error: EdgeError | None = None  # no node can serve it at all, or it was shed
    flow: _Flow | None = None  # its queue in a FairQueue
    # Its cache hold (`edge.fleet.cachehold`): when it first passed up a free slot and
    # until when it may, the node it waits for now, whether it holds no more (or may
    # not: a retry), and the scope of its wait, whose deadline ends the hold.
    held_at: float | None = None
    hold_until: float | None = None
    holding: NodeState | None = None
    hold_over: bool = False
    scope: trio.CancelScope | None = None

    @property
    def tenant_name(self) -> str:
        return self.tenant.name if self.tenant is not None else ""


# Whom to shed and why ("queue_full", "key_full"), when one more joins.
Shed = tuple[Waiter, str]
# Tries to hand a waiter a slot: True when done with it (a slot, or an error), False
# when it cannot run yet, None when no slot is left for anyone (the pass ends).
Hand = Callable[[Waiter], bool | None]


class _Counts:
    """The waiters of a queue counted by tier and by tenant."""

    def __init__(self) -> None:
        self._tiers = dict.fromkeys(SERVICE_TIERS, 0)
        self._tenants: dict[str, int] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def by_tier(self) -> dict[str, int]:
        """Requests waiting per tier, every tier named."""
        return dict(self._tiers)

    def queued(self, tenant: str) -> int:
        """Requests of `tenant` waiting."""
        return self._tenants.get(tenant, 0)

    def _counted(self, waiter: Waiter, step: int) -> None:
        self._size += step
        self._tiers[waiter.tier] += step
        name = waiter.tenant_name
        left = self._tenants.get(name, 0) + step
        if left:
            self._tenants[name] = left
        else:
            self._tenants.pop(name, None)


class FifoQueue(_Counts):
    """One queue in arrival order (`[admission] policy = "fifo"`)."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters: deque[Waiter] = deque()

    def __iter__(self) -> Iterator[Waiter]:
        return iter(list(self._waiters))

    def push(self, waiter: Waiter, *, first: bool = False) -> None:
        if first:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        self._counted(waiter, 1)

    def remove(self, waiter: Waiter) -> None:
        self._waiters.remove(waiter)
        self._counted(waiter, -1)

    def dispatch(self, hand: Hand) -> list[Waiter]:
        """Hand slots from the head: up to SCAN waiters looked at; those done leave."""
        waiters = self._waiters
        handed = []
        for waiter in list(islice(waiters, SCAN)):
            done = hand(waiter)
            if done is None:
                break
            if done:
                handed.append(waiter)
        for waiter in handed:
            if waiters[0] is waiter:
                waiters.popleft()
            else:
                waiters.remove(waiter)
            self._counted(waiter, -1)
        return handed

    def shed_for(self, waiter: Waiter, max_queue: int, max_per_key: int) -> Shed | None:
        """The newcomer, when the queue is full."""
        return (waiter, "queue_full") if len(self) >= max_queue else None


@dataclass(slots=True, eq=False)
class _Flow:
    """One tenant's requests in one band, and its place in the band's turns."""

    name: str
    weight: float
    waiters: deque[Waiter] = field(default_factory=deque)
    tag: float = 0.0  # the virtual time its head's turn starts at
    finish: float = 0.0  # the virtual time its last request served finished at
    entry: int = -1  # its live entry in the band's turns (-1: none)

    @property
    def load(self) -> float:
        return len(self.waiters) / self.weight


class _Band:
    """The flows of one tier, their turns (by tag) and their loads (for shedding)."""

    __slots__ = ("flows", "idle", "loads", "sweep_at", "turns", "vtime")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No flow, no turn: the band's state when it starts (and once it is empty)."""
        self.flows: dict[str, _Flow] = {}
        self.turns: list[tuple[float, int, _Flow]] = []  # a heap by tag
        self.loads: list[tuple[float, int, _Flow]] = []  # a heap by -load, stale entries left
        self.vtime = 0.0
        self.idle = 0  # flows kept with no request waiting (for the tag they finished at)
        self.sweep_at = _IDLE_KEPT  # idle flows past which the spent ones are forgotten

    def sweep(self) -> None:
        """Forget the idle flows with no credit left; sweep again only past twice as many."""
        spent = [n for n, f in self.flows.items() if not f.waiters and f.finish <= self.vtime]
        for name in spent:
            del self.flows[name]
        self.idle -= len(spent)
        self.sweep_at = max(_IDLE_KEPT, 2 * self.idle)

    def heaviest(self) -> _Flow | None:
        """The flow with the most requests waiting for its weight (stale entries dropped)."""
        loads = self.loads
        while loads:
            minus, _, flow = loads[0]
            if flow.waiters and -minus == flow.load and self.flows.get(flow.name) is flow:
                return flow
            heapq.heappop(loads)
        return None


class FairQueue(_Counts):
    """Bands by tier, a flow per tenant in each, weighted fair turns (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._bands = tuple(_Band() for _ in SERVICE_TIERS)
        self._seq = count()

    def __iter__(self) -> Iterator[Waiter]:
        return iter([w for b in self._bands for f in b.flows.values() for w in f.waiters])

    def push(self, waiter: Waiter, *, first: bool = False) -> None:
        b = self._bands[band(waiter.tier)]
        tenant = waiter.tenant
        weight = tenant.weight if tenant is not None else 1.0
        flow = b.flows.get(waiter.tenant_name)
        if flow is None:
            flow = b.flows[waiter.tenant_name] = _Flow(waiter.tenant_name, weight)
        elif not flow.waiters:
            b.idle -= 1
        flow.weight = weight
        if first:
            flow.waiters.appendleft(waiter)
        else:
            flow.waiters.append(waiter)
        waiter.flow = flow
        if len(flow.waiters) == 1:
            flow.tag = max(b.vtime, flow.finish)
            self._turn(b, flow)
        self._loaded(b, flow)
        self._counted(waiter, 1)

    def remove(self, waiter: Waiter) -> None:
        flow = waiter.flow
        assert flow is not None
        flow.waiters.remove(waiter)
        self._left(self._bands[band(waiter.tier)], flow, waiter)

    def dispatch(self, hand: Hand) -> list[Waiter]:
        """Hand slots band by band, flow by flow in tag order (see the module doc)."""
        handed: list[Waiter] = []
        looks = 0
        left = True  # some slot may be left
        for b in self._bands:
            aside: list[tuple[_Flow, int]] = []
            while left and b.turns and looks < LOOKS:
                _, entry, flow = heapq.heappop(b.turns)
                if entry != flow.entry:
                    continue  # a turn it lost (emptied) or took again since
                done = None
                for waiter in list(islice(flow.waiters, min(SCAN, LOOKS - looks))):
                    looks += 1
                    took = hand(waiter)
                    if took is None:
                        left = False
                        break
                    if took:
                        done = waiter
                        break
                if done is None:
                    aside.append((flow, entry))  # keeps its turn, for a slot it can use
                    continue
                flow.entry = -1
                handed.append(done)
                self._served(b, flow, done)
            for flow, entry in aside:  # back in their places (their tags, their ties)
                heapq.heappush(b.turns, (flow.tag, entry, flow))
            if not left:
                break
        return handed

    def shed_for(self, waiter: Waiter, max_queue: int, max_per_key: int) -> Shed | None:
        """Whom to shed for `waiter` to join (itself, or one waiting), or None."""
        mine = band(waiter.tier)
        name = waiter.tenant_name
        if waiter.tenant is not None and self.queued(name) >= max_per_key:
            least = max(i for i, b in enumerate(self._bands) if name in b.flows
                        and b.flows[name].waiters)  # fmt: skip
            if mine >= least:
                return waiter, "key_full"
            return self._bands[least].flows[name].waiters[-1], "key_full"
        if len(self) < max_queue:
            return None
        least = max((i for i, n in enumerate(self.by_tier().values()) if n), default=mine)
        if mine > least:
            return waiter, "queue_full"
        b = self._bands[least]
        heavy = b.heaviest()
        if mine == least:
            flow = b.flows.get(name)
            weight = waiter.tenant.weight if waiter.tenant is not None else 1.0
            load = ((len(flow.waiters) if flow is not None else 0) + 1) / weight
            if heavy is None or load >= heavy.load:
                return waiter, "queue_full"
        assert heavy is not None
        return heavy.waiters[-1], "queue_full"

    def _turn(self, b: _Band, flow: _Flow) -> None:
        flow.entry = next(self._seq)
        heapq.heappush(b.turns, (flow.tag, flow.entry, flow))

    def _loaded(self, b: _Band, flow: _Flow) -> None:
        """`flow`'s load changed: its entry among the loads (the stale ones compacted)."""
        if flow.waiters:
            heapq.heappush(b.loads, (-flow.load, next(self._seq), flow))
        if len(b.loads) > 4 * len(b.flows) + 64:
            b.loads = [(-f.load, next(self._seq), f) for f in b.flows.values() if f.waiters]
            heapq.heapify(b.loads)

    def _served(self, b: _Band, flow: _Flow, waiter: Waiter) -> None:
        """`waiter` got its slot: its flow's turn moves on by 1 / its weight."""
        if flow.waiters[0] is waiter:
            flow.waiters.popleft()
        else:
            flow.waiters.remove(waiter)
        b.vtime = max(b.vtime, flow.tag)
        flow.finish = max(b.vtime, flow.tag + 1 / flow.weight)
        if flow.waiters:
            flow.tag = flow.finish
            self._turn(b, flow)
        self._left(b, flow, waiter)

    def _left(self, b: _Band, flow: _Flow, waiter: Waiter) -> None:
        """`waiter` is out of `flow` (served, gone or shed)."""
        waiter.flow = None
        self._counted(waiter, -1)
        self._loaded(b, flow)
        if flow.waiters:
            return
        flow.entry = -1
        if not self._tiers[waiter.tier]:
            b.reset()  # the band is empty: its turns start afresh
            return
        if flow.finish <= b.vtime:
            del b.flows[flow.name]  # no credit left to remember
            return
        b.idle += 1
        if b.idle > b.sweep_at:
            b.sweep()
