"""The fair queue's order and shedding (edge.fleet.queues), as pure bookkeeping.

A "slot" here is one `dispatch` whose `hand` takes the first waiter it may: the order
waiters are handed out in is the order the queue serves them. Property tests check
the shares by weight, FIFO within a tenant, strict bands and the counts under any mix
of joins, departures and dispatches; the others, one rule each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.fleet.queues import LOOKS, SCAN, FairQueue, FifoQueue, Waiter
from edge.fleet.tenants import SERVICE_TIERS, Tenant
from edge.observe.metrics import QUEUE_TIERS


def _waiter(tenant: Tenant | None, tier: str = "default", model: str = "m") -> Waiter:
    return Waiter(model, False, (), None, None, tenant, tier)


def _serve(
    queue: FairQueue | FifoQueue, *, runs: Callable[[Waiter], bool] | None = None
) -> Waiter | None:
    """One slot: the first waiter the queue offers that `runs` (default: any)."""
    taken: list[Waiter] = []

    def hand(waiter: Waiter) -> bool:
        if taken or (runs is not None and not runs(waiter)):
            return False
        taken.append(waiter)
        return True

    handed = queue.dispatch(hand)
    assert handed == taken
    return taken[0] if taken else None


def test_the_tiers_are_the_configured_ones() -> None:
    assert QUEUE_TIERS == SERVICE_TIERS


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=2, max_size=6), st.integers(50, 400))
def test_backlogged_tenants_get_slots_in_proportion_to_their_weights(
    weights: list[int], slots: int
) -> None:
    """Every tenant always has requests waiting: after any number of slots, what each got
    for its weight differs from another's by at most one turn of each (SFQ's bound)."""
    queue = FairQueue()
    tenants = [Tenant(f"t{i}", weight=w) for i, w in enumerate(weights)]
    for tenant in tenants:
        for _ in range(3):
            queue.push(_waiter(tenant))
    served: Counter[str] = Counter()
    for _ in range(slots):
        waiter = _serve(queue)
        assert waiter is not None
        assert waiter.tenant is not None
        served[waiter.tenant.name] += 1
        queue.push(_waiter(waiter.tenant))  # it stays backlogged
        for a in tenants:
            for b in tenants:
                gap = served[a.name] / a.weight - served[b.name] / b.weight
                assert gap <= 1 / a.weight + 1 / b.weight + 1e-9


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["join", "leave", "serve"]),
            st.integers(0, 3),
            st.sampled_from(SERVICE_TIERS),
            st.booleans(),
        ),
        max_size=120,
    )
)
def test_any_mix_keeps_fifo_per_tenant_strict_bands_and_the_counts(
    steps: list[tuple[str, int, str, bool]],
) -> None:
    """Joins (at the back, or the front: a retry), departures and slots in any order: each
    tenant's requests of a band are served in its queue's order, no request is served
    while a more urgent one that could run waits, and the counts by tier and tenant are
    the requests still waiting."""
    queue = FairQueue()
    tenants = [Tenant(f"t{i}", weight=i + 1) for i in range(4)]
    waiting: list[Waiter] = []
    order: dict[tuple[str, str], list[Waiter]] = {}
    for op, who, tier, first in steps:
        tenant = tenants[who]
        if op == "join":
            waiter = _waiter(tenant, tier)
            queue.push(waiter, first=first)
            waiting.append(waiter)
            line = order.setdefault((tenant.name, tier), [])
            line.insert(0, waiter) if first else line.append(waiter)
        elif op == "leave" and waiting:
            waiter = waiting.pop(who % len(waiting))
            queue.remove(waiter)
            order[(waiter.tenant_name, waiter.tier)].remove(waiter)
        elif op == "serve":
            waiter = _serve(queue)
            if waiter is None:
                assert not waiting
                continue
            urgent = min(SERVICE_TIERS.index(w.tier) for w in waiting)
            assert SERVICE_TIERS.index(waiter.tier) == urgent
            assert order[(waiter.tenant_name, waiter.tier)].pop(0) is waiter
            waiting.remove(waiter)
        assert len(queue) == len(waiting)
        assert queue.by_tier() == {t: sum(w.tier == t for w in waiting) for t in SERVICE_TIERS}
        for tenant in tenants:
            assert queue.queued(tenant.name) == sum(w.tenant is tenant for w in waiting)
        assert sorted(map(id, queue)) == sorted(map(id, waiting))


def test_a_tenant_with_one_request_is_served_within_one_round() -> None:
    """A victim beside a flood: its one request goes out before the flood's next."""
    queue = FairQueue()
    flood, victim = Tenant("flood"), Tenant("victim")
    for _ in range(50):
        queue.push(_waiter(flood))
    assert _serve(queue).tenant is flood  # type: ignore[union-attr]
    queue.push(_waiter(victim))
    served = [_serve(queue) for _ in range(2)]
    assert victim in [w.tenant for w in served if w is not None]


def test_a_request_that_cannot_run_keeps_its_turn_and_holds_no_one_up() -> None:
    """A's request waits for a model whose nodes are full: B's requests take the slots they
    can meanwhile; once A's model frees up, A is served before B's next."""
    queue = FairQueue()
    a, b = Tenant("a"), Tenant("b")
    stuck = _waiter(a, model="busy")
    queue.push(stuck)
    for _ in range(5):
        queue.push(_waiter(b))
    for _ in range(3):
        served = _serve(queue, runs=lambda w: w.model != "busy")
        assert served is not None
        assert served.tenant is b
    assert _serve(queue) is stuck


def test_a_more_urgent_request_that_cannot_run_does_not_hold_up_a_band_below() -> None:
    queue = FairQueue()
    queue.push(_waiter(Tenant("p"), "priority", model="busy"))
    default = _waiter(Tenant("d"), "default")
    queue.push(default)
    assert _serve(queue, runs=lambda w: w.model != "busy") is default


def test_past_its_bound_a_tenant_loses_its_own_newest() -> None:
    """At max_queue_per_key, a tenant's newcomer is shed when it is in the tenant's least
    urgent band; a more urgent one displaces the tenant's newest of that band."""
    queue = FairQueue()
    t = Tenant("t", tiers=("priority", "default", "flex"))
    old = [_waiter(t, "default") for _ in range(2)]
    for waiter in old:
        queue.push(waiter)
    same = _waiter(t, "default")
    assert queue.shed_for(same, max_queue=100, max_per_key=2) == (same, "key_full")
    assert queue.shed_for(_waiter(t, "priority"), 100, 2) == (old[-1], "key_full")
    assert queue.shed_for(_waiter(Tenant("other")), 100, 2) is None


def test_a_full_queue_sheds_flex_then_default_then_priority_heaviest_tenant_first() -> None:
    queue = FairQueue()
    heavy, light = Tenant("heavy"), Tenant("light")
    flex = [_waiter(heavy, "flex"), _waiter(heavy, "flex"), _waiter(light, "flex")]
    defaults = [_waiter(heavy, "default"), _waiter(light, "default")]
    for waiter in [*flex, *defaults]:
        queue.push(waiter)
    newcomer = _waiter(Tenant("new"), "default")
    # Flex goes first: the newest of the tenant with the most flex waiting.
    assert queue.shed_for(newcomer, max_queue=5, max_per_key=100) == (flex[1], "queue_full")
    # A flex newcomer to a full queue: shed itself unless it is lighter than the heaviest.
    assert queue.shed_for(_waiter(heavy, "flex"), 5, 100)[0].tenant is heavy  # type: ignore[index]
    lighter = _waiter(Tenant("new"), "flex")
    assert queue.shed_for(lighter, 5, 100) == (flex[1], "queue_full")
    for waiter in flex:
        queue.remove(waiter)
    queue.push(_waiter(heavy, "default"))
    queue.push(_waiter(heavy, "default"))
    queue.push(_waiter(light, "priority"))
    # Default next: a priority newcomer displaces the heaviest default tenant's newest.
    victim, reason = queue.shed_for(_waiter(light, "priority"), 5, 100)  # type: ignore[misc]
    assert (victim.tenant, victim.tier, reason) == (heavy, "default", "queue_full")
    # A default newcomer equal to the heaviest (none waiting but itself): itself.
    one_each = FairQueue()
    for i in range(3):
        one_each.push(_waiter(Tenant(f"x{i}")))
    alone = _waiter(Tenant("y"))
    assert one_each.shed_for(alone, 3, 100) == (alone, "queue_full")


def test_priority_is_shed_only_when_nothing_else_is_left() -> None:
    queue = FairQueue()
    for i in range(3):
        queue.push(_waiter(Tenant(f"p{i}"), "priority"))
    assert queue.shed_for(_waiter(Tenant("d")), 3, 100)[1] == "queue_full"  # type: ignore[index]
    heavy = Tenant("heavy")
    queue.push(_waiter(heavy, "priority"))
    newest = _waiter(heavy, "priority")
    queue.push(newest)
    assert queue.shed_for(_waiter(Tenant("p9"), "priority"), 5, 100) == (newest, "queue_full")


def test_the_fifo_queue_sheds_the_newcomer_and_serves_in_arrival_order() -> None:
    queue = FifoQueue()
    tenants = [Tenant("a"), Tenant("b")]
    waiters = [_waiter(tenants[i % 2], tier) for i, tier in enumerate(["flex", "default"] * 2)]
    for waiter in waiters:
        queue.push(waiter)
    newcomer = _waiter(tenants[0], "priority")
    assert queue.shed_for(newcomer, 4, 1) == (newcomer, "queue_full")
    assert [_serve(queue) for _ in waiters] == waiters


def test_ten_thousand_tenants_waiting_cost_a_dispatch_a_bounded_look() -> None:
    """Every tenant's request waits for a full model, one can run: a dispatch looks at
    most LOOKS requests, never each tenant's; served, the flows are forgotten."""
    queue = FairQueue()
    for i in range(10_000):
        queue.push(_waiter(Tenant(f"t{i}"), model="full"))
    looked = 0

    def hand(waiter: Waiter) -> bool:
        nonlocal looked
        looked += 1
        return False

    assert queue.dispatch(hand) == []
    assert looked <= LOOKS
    assert len(queue) == 10_000
    while _serve(queue) is not None:
        pass
    assert len(queue) == 0
    assert sum(len(b.flows) for b in queue._bands) <= SCAN  # no credit left to remember


@pytest.mark.parametrize("first", [False, True])
def test_a_retry_goes_to_the_front_of_its_tenant(first: bool) -> None:
    queue = FairQueue()
    t = Tenant("t")
    old, retry = _waiter(t), _waiter(t)
    queue.push(old)
    queue.push(retry, first=first)
    assert _serve(queue) is (retry if first else old)


@pytest.mark.parametrize("queue", [FairQueue(), FifoQueue()], ids=["fair", "fifo"])
def test_a_pass_ends_once_no_slot_is_left(queue: FairQueue | FifoQueue) -> None:
    """`hand` says no slot is left for anyone: nothing more is looked at, and the ones
    not served keep their places."""
    waiters = [_waiter(Tenant(f"t{i}")) for i in range(5)]
    for waiter in waiters:
        queue.push(waiter)
    looked: list[Waiter] = []

    def hand(waiter: Waiter) -> bool | None:
        looked.append(waiter)
        return True if len(looked) == 1 else None

    assert queue.dispatch(hand) == [waiters[0]]
    assert len(looked) == 2
    assert len(queue) == 4
    assert [_serve(queue) for _ in range(4)] == waiters[1:]
