"""The cache hold (edge.fleet.cachehold): its rule on node states, and the admission
queue with it under trio's MockClock.

Pools are made as in tests/unit/test_pool.py (no node is contacted), cache-aware, with
nodes capped by the edge; a node holds a prefix because a request of it was routed
there (the approximate index), as in tests/unit/test_cacheaware.py.
"""

from __future__ import annotations

from array import array

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from edge.config import AdmissionConfig, RoutingConfig
from edge.fleet import cachehold
from edge.fleet.admission import Admission
from edge.fleet.cacheaware import Route
from edge.fleet.cachehold import better_node, slot_freed
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.fleet.tenants import Tenant
from edge.observe.metrics import CACHE_HOLD_OUTCOMES, EdgeMetrics
from tests.unit.test_admission import _sample
from tests.unit.test_pool import make_pool

HOLD_S = 1.0
PROMPT = 20  # blocks of a prompt


def blocks(start: int, n: int = PROMPT) -> array[int]:
    return array("Q", range(start, start + n))


# Two prompts, each cached on one node (`cache_pool`), and one cached nowhere.
ON_A, ON_B, NOWHERE = blocks(1_000), blocks(2_000), blocks(3_000)


def cache_pool(
    slots: int = 1, hold_s: float = HOLD_S, names: tuple[str, ...] = ("a", "b")
) -> tuple[NodePool, list[NodeState]]:
    """Cache-aware nodes of `slots` slots each, the first holding ON_A, the second ON_B."""
    routing = RoutingConfig(policy="cache_aware", cache_hold_s=hold_s)
    pool, _, nodes = make_pool(*names, routing=routing, max_runs=dict.fromkeys(names, slots))
    for state, prompt in zip(nodes, (ON_A, ON_B), strict=False):
        state.cache.routed(prompt, 0)
    return pool, nodes


def admission_of(pool: NodePool, policy: str = "fifo") -> tuple[Admission, EdgeMetrics]:
    metrics = EdgeMetrics()
    config = AdmissionConfig(max_queue=100, max_queue_per_key=100, policy=policy)
    return Admission(pool, config, metrics), metrics


def holds(metrics: EdgeMetrics) -> dict[str, float]:
    name = "iop_edge_cache_holds_total"
    return {o: _sample(metrics, name, outcome=o) for o in CACHE_HOLD_OUTCOMES}


async def fill(admission: Admission, pool: NodePool) -> list[NodeState]:
    """Every slot taken, by requests without a prompt worth routing."""
    taken = []
    while any(s.has_slot() for s in pool.nodes):
        taken.append(await admission.acquire("m"))
    return taken


class Served:
    """Requests in their own tasks: the order they got a slot, and the node."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.got: list[tuple[str, str]] = []

    async def one(self, tag: str, prompt: array[int] | None, tenant: Tenant | None = None) -> None:
        route = Route(prompt) if prompt is not None else None
        node = await self.admission.acquire("m", route=route, tenant=tenant)
        self.got.append((tag, node.client.name))

    async def start(
        self, nursery: trio.Nursery, tag: str, prompt: array[int] | None, **kw: Tenant
    ) -> None:
        nursery.start_soon(self.one, tag, prompt, kw.get("tenant"))
        await trio.testing.wait_all_tasks_blocked()


# --- the rule, on node states -----------------------------------------------------------


def wait_for(
    prompt: array[int],
    nodes: list[NodeState],
    *,
    waiting: dict[NodeState, int] | None = None,
    left_s: float = HOLD_S,
    placed: str | None = None,
    within: list[bool] | None = None,
) -> NodeState | None:
    """The rule at the default cache_threshold (0.3)."""
    return better_node(
        prompt, nodes, threshold=0.3, left_s=left_s, waiting=waiting or {}, placed=placed,
        within=within,
    )  # fmt: skip


def test_a_busy_node_holding_much_more_is_waited_for() -> None:
    """Node a busy and holding the prompt, b free and holding none of it: a. With b
    holding as much, or a holding less than cache_threshold of it more, or every node
    free, or none: no node is worth passing the free slot up."""
    _, (a, b) = cache_pool()
    a.in_flight = 1
    assert wait_for(ON_A, [a, b]) is a
    assert wait_for(ON_B, [a, b]) is None  # b holds it, and is free
    assert wait_for(NOWHERE, [a, b]) is None
    short = array("Q", [*ON_A[:5], *NOWHERE])  # a holds 5 of its 25 blocks: under 0.3
    assert wait_for(short, [a, b]) is None
    b.cache.routed(ON_A, 1)
    assert wait_for(ON_A, [a, b]) is None  # the free node holds it too
    b.in_flight = 1
    assert wait_for(ON_A, [a, b]) is None  # nothing free to pass up
    a.in_flight = b.in_flight = 0
    assert wait_for(ON_A, [a, b]) is None  # nothing to wait for


def test_a_node_past_the_bounds_is_not_waited_for_and_a_placement_is() -> None:
    """A busy node past the cache-aware bounds on load or share is not waited for; a
    busy node this edge placed the prompt on (a miss) is, before it holds a block."""
    _, (a, b) = cache_pool()
    a.in_flight = 1
    assert wait_for(ON_A, [a, b], within=[False, True]) is None
    assert wait_for(NOWHERE, [a, b], placed="a") is a
    assert wait_for(NOWHERE, [a, b], placed="b") is None  # b is free


def test_a_node_is_waited_for_only_while_its_slot_is_expected_in_time() -> None:
    """A node that frees a slot every 0.3 s: with 1 s of hold left, three requests wait
    for it, not a fourth; with no time known yet, as many as it has slots."""
    _, (a, b) = cache_pool(slots=2)
    a.in_flight = 2
    assert wait_for(ON_A, [a, b], waiting={a: 1}) is a
    assert wait_for(ON_A, [a, b], waiting={a: 2}) is None
    a.free_every = 0.3
    assert wait_for(ON_A, [a, b], waiting={a: 2}) is a
    assert wait_for(ON_A, [a, b], waiting={a: 3}) is None
    assert wait_for(ON_A, [a, b], left_s=0.2) is None


def test_of_two_busy_nodes_the_one_holding_more_is_waited_for() -> None:
    """Nodes a and c busy, a holding 10 blocks of the prompt and c all 20: c."""
    _, (a, b, c) = cache_pool(names=("a", "b", "c"))
    a.cache.routed(blocks(9_000, 10), 0)
    c.cache.routed(blocks(9_000), 0)
    a.in_flight = c.in_flight = 1
    assert wait_for(blocks(9_000), [a, b, c]) is c


def test_the_time_between_slots_freed_counts_only_full_nodes() -> None:
    """A node gives back slots while full at 0, 1 and 3 s: 1 s, then smoothed toward 2 s;
    a slot given back while not full starts a new interval."""
    _, (a, _) = cache_pool(slots=2)
    a.in_flight = 2
    for now in (0.0, 1.0, 3.0):
        slot_freed(a, now)
    assert a.free_every == pytest.approx(1.0 + 0.2 * (2.0 - 1.0))
    a.in_flight = 1
    slot_freed(a, 10.0)
    a.in_flight = 2
    slot_freed(a, 20.0)
    assert a.free_every == pytest.approx(1.2)  # no interval across the slot not full
    assert a.freed_at == 20.0


def test_the_outcomes_are_the_metrics_labels() -> None:
    """Every way a hold ends is a label of iop_edge_cache_holds_total."""
    assert cachehold.HOLD_OUTCOMES == CACHE_HOLD_OUTCOMES


# --- the admission queue with holds -------------------------------------------------------


async def test_a_waiter_passes_up_a_slot_for_its_node_and_one_behind_takes_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Both nodes busy; the head waits for ON_A (on a), the next has no prompt worth
    routing. b frees: the second takes it, the head keeps waiting; a frees: the head
    takes it, a hold served."""
    pool, (a, b) = cache_pool()
    admission, metrics = admission_of(pool)
    await fill(admission, pool)
    served = Served(admission)
    async with trio.open_nursery() as nursery:
        await served.start(nursery, "head", ON_A)
        await served.start(nursery, "plain", None)
        admission.release(b)
        await trio.testing.wait_all_tasks_blocked()
        assert served.got == [("plain", "b")]
        assert admission.depth == 1
        admission.release(a)
    assert served.got == [("plain", "b"), ("head", "a")]
    assert holds(metrics) == {"served": 1, "expired": 0, "left": 0}
    assert _sample(metrics, "iop_edge_cache_hold_seconds_count") == 1


async def test_a_hold_ends_at_its_bound_and_the_waiter_takes_the_free_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Alone in the queue, the waiter for a passes up b's slot: it stays free for
    cache_hold_s, then the waiter takes it (a hold expired), cache_hold_s after it
    passed it up."""
    pool, (_, b) = cache_pool()
    admission, metrics = admission_of(pool)
    await fill(admission, pool)
    served = Served(admission)
    async with trio.open_nursery() as nursery:
        await served.start(nursery, "head", ON_A)
        admission.release(b)
        passed_at = trio.current_time()
        await trio.testing.wait_all_tasks_blocked()
        assert served.got == []
        assert b.has_slot()
    assert served.got == [("head", "b")]
    assert trio.current_time() - passed_at == pytest.approx(HOLD_S)
    assert holds(metrics) == {"served": 0, "expired": 1, "left": 0}


async def test_without_a_hold_the_head_takes_the_first_slot_freed() -> None:
    """cache_hold_s = 0: the head takes b's slot at once, whatever a holds."""
    pool, (a, b) = cache_pool(hold_s=0)
    admission, metrics = admission_of(pool)
    await fill(admission, pool)
    served = Served(admission)
    async with trio.open_nursery() as nursery:
        await served.start(nursery, "head", ON_A)
        await served.start(nursery, "plain", None)
        admission.release(b)
        await trio.testing.wait_all_tasks_blocked()
        assert served.got == [("head", "b")]
        admission.release(a)
    assert holds(metrics) == dict.fromkeys(CACHE_HOLD_OUTCOMES, 0)


async def test_a_waiter_that_held_keeps_its_turn(autojump_clock: trio.testing.MockClock) -> None:
    """The head holds for a; the second takes b's slot. Its hold over, the head takes the
    next slot freed before the third, who came after it."""
    pool, (a, b) = cache_pool()
    admission, _ = admission_of(pool)
    await fill(admission, pool)
    served = Served(admission)
    async with trio.open_nursery() as nursery:
        await served.start(nursery, "head", ON_A)
        await served.start(nursery, "second", None)
        await served.start(nursery, "third", None)
        admission.release(b)
        await trio.testing.wait_all_tasks_blocked()
        assert served.got == [("second", "b")]
        await trio.sleep(2 * HOLD_S)  # the head's hold is over; no slot is free
        assert served.got == [("second", "b")]
        admission.release(b)
        await trio.testing.wait_all_tasks_blocked()
        assert served.got == [("second", "b"), ("head", "b")]
        admission.release(a)
    assert served.got[-1] == ("third", "a")


async def test_tenants_keep_their_turns_while_one_holds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Fair queue: tenant x's request holds for a, tenant y's flood takes the slots b
    frees; when a frees, x's request takes it before y's, whose turn it would not be."""
    pool, (a, b) = cache_pool()
    admission, _ = admission_of(pool, policy="fair")
    await fill(admission, pool)
    x, y = Tenant("x", named=True), Tenant("y", named=True)
    served = Served(admission)
    async with trio.open_nursery() as nursery:
        await served.start(nursery, "y0", None, tenant=y)
        await served.start(nursery, "x0", ON_A, tenant=x)
        await served.start(nursery, "y1", None, tenant=y)
        await served.start(nursery, "y2", None, tenant=y)
        for _ in range(2):
            admission.release(b)
            await trio.testing.wait_all_tasks_blocked()
        assert served.got == [("y0", "b"), ("y1", "b")]
        admission.release(a)
        await trio.testing.wait_all_tasks_blocked()
        assert served.got[-1] == ("x0", "a")
        admission.release(b)
    assert served.got[-1] == ("y2", "b")


async def test_a_new_request_waits_for_its_busy_node_rather_than_miss(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """a busy, b free, the queue empty: a request for ON_A joins the queue, and gets a's
    slot when it frees; one for ON_B takes b at once meanwhile."""
    pool, (a, b) = cache_pool(slots=2)
    admission, metrics = admission_of(pool)
    a.in_flight = 2
    served = Served(admission)
    async with trio.open_nursery() as nursery:
        await served.start(nursery, "on_a", ON_A)
        assert admission.depth == 1
        assert b.in_flight == 0
        assert await admission.acquire("m", route=Route(ON_B)) is b
        admission.release(a)
    assert served.got == [("on_a", "a")]
    assert holds(metrics) == {"served": 1, "expired": 0, "left": 0}


async def test_a_retry_takes_the_free_slot_whatever_it_holds() -> None:
    """A retry (`first`: it waited its turn already) passes up no slot: a busy and
    holding its prompt, it takes b at once."""
    pool, (a, b) = cache_pool()
    admission, metrics = admission_of(pool)
    a.in_flight = 1
    assert await admission.acquire("m", route=Route(ON_A), first=True) is b
    assert holds(metrics) == dict.fromkeys(CACHE_HOLD_OUTCOMES, 0)


async def test_a_new_request_the_queue_would_shed_for_takes_the_free_slot() -> None:
    """max_queue 1 with one request waiting (for a): a new request for ON_A takes b's free
    slot rather than wait, since waiting would shed it."""
    pool, (a, b) = cache_pool()
    admission = Admission(pool, AdmissionConfig(max_queue=1), EdgeMetrics())
    await fill(admission, pool)
    served = Served(admission)
    async with trio.open_nursery() as nursery:
        await served.start(nursery, "head", ON_A)
        admission.release(b)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.depth == 1  # the head holds for a
        assert b.has_slot()
        assert await admission.acquire("m", route=Route(ON_A)) is b
        admission.release(a)
    assert served.got == [("head", "a")]


async def test_a_waiter_that_leaves_while_holding_is_counted_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A holding waiter whose client goes leaves the queue; its hold counts as left."""
    pool, (_, b) = cache_pool()
    admission, metrics = admission_of(pool)
    await fill(admission, pool)
    served = Served(admission)
    with trio.move_on_after(HOLD_S / 2):
        async with trio.open_nursery() as nursery:
            await served.start(nursery, "head", ON_A)
            admission.release(b)
    assert admission.depth == 0
    assert served.got == []
    assert holds(metrics) == {"served": 0, "expired": 0, "left": 1}


# --- the bound and the turns, for any arrivals and releases --------------------------------

STEP = 0.1  # the test's clock moves by this much at a time
PROMPTS = (ON_A, ON_B, NOWHERE, None)
TENANTS = (Tenant("x", named=True), Tenant("y", named=True))


class _Trace:
    """What the requests of one run did: who waits, since when a slot was free for each
    (its time waited with a slot free), who was served."""

    def __init__(self) -> None:
        self.waiting: dict[int, tuple[Tenant, array[int] | None]] = {}
        self.idle: dict[int, float] = {}
        self.served: list[int] = []
        self.tenants: dict[int, Tenant] = {}
        # While y (whose requests hold nothing) has one waiting: the slots each tenant
        # had when it began to wait.
        self.since: dict[Tenant, int] | None = None

    def check(self, policy: str, served: list[int]) -> None:
        """The requests just `served` overtook only requests that hold: one still waiting
        that came before one of them (of its tenant, under fair) holds out for a node
        holding its prompt, within its bound. The bound: a request waits with a slot free
        only while it holds. Under fair, the tenants' turns: while y waits, x gets no more
        than one slot past y's share (equal weights: they take turns)."""
        for by in served:
            tenant = self.tenants[by]
            for i, (t, prompt) in self.waiting.items():
                if i < by and (policy == "fifo" or t is tenant):
                    assert prompt is not None
                    assert self.idle[i] < HOLD_S + STEP
        assert all(self.idle[k] <= HOLD_S + STEP for k in self.waiting)
        if policy != "fair":
            return
        x, y = TENANTS
        if not any(t is y for t, _ in self.waiting.values()):
            self.since = None
            return
        slots = {t: sum(1 for i in self.served if self.tenants[i] is t) for t in TENANTS}
        if self.since is None:
            self.since = slots
        assert slots[x] - self.since[x] <= slots[y] - self.since[y] + 1


def _hold_run(policy: str, ops: list[tuple[str, int, int]]) -> None:
    """Requests join (a tenant, a prompt), slots are given back, the clock moves; the bound
    and the turns are checked at every step."""
    trace = _Trace()

    async def join(i: int, tenant: Tenant, prompt: array[int] | None) -> None:
        trace.waiting[i] = (tenant, prompt)
        trace.tenants[i] = tenant
        trace.idle[i] = 0.0
        route = Route(prompt) if prompt is not None else None
        node = await admission.acquire("m", route=route, tenant=tenant)
        del trace.waiting[i]
        trace.served.append(i)
        taken.append(node)

    def free() -> bool:
        return any(s.has_slot() for s in pool.nodes)

    async def main() -> None:
        clock = trio.lowlevel.current_clock()
        assert isinstance(clock, trio.testing.MockClock)
        async with trio.open_nursery() as nursery:
            for i, (op, a, b) in enumerate(ops):
                done = len(trace.served)
                if op == "join":  # y's requests hold nothing: no prompt worth routing
                    tenant = TENANTS[a % 2]
                    prompt = PROMPTS[b % 4] if tenant is TENANTS[0] else None
                    nursery.start_soon(join, i, tenant, prompt)
                elif op == "release" and taken:
                    admission.release(taken.pop(a % len(taken)))
                elif op == "wait":
                    for _ in range(a % 12 + 1):
                        was_free = free()
                        clock.jump(STEP)
                        await trio.testing.wait_all_tasks_blocked()
                        for k in trace.waiting if was_free else ():
                            trace.idle[k] += STEP
                        trace.check(policy, trace.served[done:])
                        done = len(trace.served)
                await trio.testing.wait_all_tasks_blocked()
                trace.check(policy, trace.served[done:])
            while trace.waiting:  # never starved: the rest are served as slots free
                if taken:
                    admission.release(taken.pop())
                clock.jump(STEP)
                await trio.testing.wait_all_tasks_blocked()
                assert all(trace.idle[k] <= HOLD_S + 2 * STEP for k in trace.waiting)
            nursery.cancel_scope.cancel()

    pool, _ = cache_pool(slots=2)
    admission, _ = admission_of(pool, policy)
    taken: list[NodeState] = []
    trio.run(main, clock=trio.testing.MockClock())


@given(
    st.sampled_from(["fair", "fifo"]),
    st.lists(
        st.tuples(
            st.sampled_from(["join", "join", "release", "wait"]),
            st.integers(0, 20),
            st.integers(0, 20),
        ),
        max_size=30,
    ),
)
def test_nobody_waits_past_its_hold_and_nobody_loses_its_turn(
    policy: str, ops: list[tuple[str, int, int]]
) -> None:
    """Under either policy, for any arrivals (tenant x's prompts cached on one node, on
    the other, nowhere or none; tenant y's none) and slots given back: a request waits
    with a slot free for no longer than cache_hold_s in all (its wait is its queue time
    plus at most its hold); one that came later is served before it (before it of its
    tenant, under fair) only while it holds out for a node holding its prompt; under
    fair, while y waits x takes no more than its turns; and every request is served."""
    _hold_run(policy, ops)
