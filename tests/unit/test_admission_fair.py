"""The admission queue's fair policy under trio: tenants, tiers, shedding, the gauges.

As tests/unit/test_admission.py: a real `NodePool` whose node states the tests set by
hand, one node of one slot, requests that wait for it.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from edge.config import AdmissionConfig
from edge.errors import FlexUnavailableError, OverloadedError
from edge.fleet.admission import Admission
from edge.fleet.tenants import Tenant
from edge.observe.metrics import EdgeMetrics
from tests.unit.test_admission import _pool, _sample

GOLD = Tenant("gold", tiers=("priority", "default", "flex"), named=True)
FLOOD = Tenant("flood", named=True)


def _admission(**config: object) -> tuple[Admission, EdgeMetrics]:
    metrics = EdgeMetrics()
    pool = _pool(("n", ("m",), 1))
    return Admission(pool, AdmissionConfig(**config), metrics), metrics  # type: ignore[arg-type]


async def _wait(
    admission: Admission,
    tenant: Tenant,
    tier: str,
    got: list[str],
    errors: list[BaseException],
    tag: str,
) -> None:
    try:
        node = await admission.acquire("m", tenant=tenant, tier=tier)
    except OverloadedError as exc:
        errors.append(exc)
        got.append(f"shed:{tag}")
        return
    got.append(tag)
    admission.release(node)


async def test_a_tenant_past_its_bound_is_shed_and_the_others_are_not() -> None:
    """max_queue_per_key 2: the flood's third request is shed at once (503, key_full);
    another tenant's request still queues, and is served before the flood's second."""
    admission, metrics = _admission(max_queue=10, max_queue_per_key=2)
    node = await admission.acquire("m")
    got: list[str] = []
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(_wait, admission, FLOOD, "default", got, errors, f"flood{i}")
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_wait, admission, GOLD, "default", got, errors, "gold")
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["shed:flood2"]
        assert isinstance(errors[0], OverloadedError)
        assert errors[0].status == 503
        assert admission.depth == 3
        assert _sample(metrics, "iop_edge_key_queued", key="flood") == 2
        assert _sample(metrics, "iop_edge_shed_total", reason="key_full", tier="default") == 1
        admission.release(node)
    assert got == ["shed:flood2", "flood0", "gold", "flood1"]
    assert _sample(metrics, "iop_edge_key_queued", key="flood") == 0


async def test_tiers_dispatch_strictly_and_flex_is_shed_first_with_a_429() -> None:
    """Flex, default and priority requests wait: a full queue sheds the flex one for a
    newcomer (woken at once: 429 rate_limit_exceeded, Retry-After); the slots go to
    priority, then default, then flex, whatever the order they came in."""
    admission, metrics = _admission(max_queue=3, max_queue_per_key=10)
    node = await admission.acquire("m")
    got: list[str] = []
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        for tier in ("flex", "default", "flex"):
            nursery.start_soon(_wait, admission, GOLD, tier, got, errors, tier)
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_wait, admission, FLOOD, "default", got, errors, "default2")
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["shed:flex"]  # the newest flex went
        shed = errors[0]
        assert isinstance(shed, FlexUnavailableError)
        assert (shed.status, shed.type, shed.code) == (429, "rate_limit_exceeded",
                                                       "rate_limit_exceeded")  # fmt: skip
        assert shed.retry_after_s >= 1
        nursery.start_soon(_wait, admission, GOLD, "priority", got, errors, "priority")
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["shed:flex", "shed:flex"]  # then the other: priority took its place
        assert admission.report() == {
            "policy": "fair", "depth": 3, "priority": 1, "default": 2, "flex": 0,
        }  # fmt: skip
        assert _sample(metrics, "iop_edge_queue_depth", tier="default") == 2
        admission.release(node)
    assert got[2:] == ["priority", "default", "default2"]
    assert _sample(metrics, "iop_edge_shed_total", reason="queue_full", tier="flex") == 2
    assert _sample(metrics, "iop_edge_queue_wait_seconds_count", tier="priority") == 1


async def test_a_queued_request_that_leaves_frees_its_tenants_place() -> None:
    """At its bound, a tenant's waiting request leaves (its client gone): the tenant may
    queue another."""
    admission, _ = _admission(max_queue=10, max_queue_per_key=1)
    await admission.acquire("m")
    got: list[str] = []
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        leaving = trio.CancelScope()

        async def leaver() -> None:
            with leaving:
                await _wait(admission, FLOOD, "default", got, errors, "leaves")

        nursery.start_soon(leaver)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(OverloadedError):
            admission.shed_if_full(FLOOD)
        leaving.cancel()
        await trio.testing.wait_all_tasks_blocked()
        admission.shed_if_full(FLOOD)
        nursery.start_soon(_wait, admission, FLOOD, "default", got, errors, "next")
        await trio.testing.wait_all_tasks_blocked()
        assert admission.depth == 1
        assert got == []
        nursery.cancel_scope.cancel()


async def test_a_reload_to_fifo_keeps_the_waiters() -> None:
    """The policy changes on a reload: the requests waiting move to the new queue."""
    admission, _ = _admission(max_queue=10)
    node = await admission.acquire("m")
    got: list[str] = []
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        for tier in ("flex", "priority"):
            nursery.start_soon(_wait, admission, GOLD, tier, got, errors, tier)
            await trio.testing.wait_all_tasks_blocked()
        admission.configure(AdmissionConfig(max_queue=10, policy="fifo"))
        assert admission.report()["policy"] == "fifo"
        assert admission.depth == 2
        admission.release(node)
    assert sorted(got) == ["flex", "priority"]


TIERS = ("priority", "default", "flex")


def _reserve_run(policy: str, kept: int, ops: list[tuple[str, int]]) -> None:
    """Joins (a tier) and releases (a slot held) on a node of 4 slots with `kept` of them
    kept for priority, the rule checked after each step."""
    held: list[str] = []
    waiting = dict.fromkeys(TIERS, 0)

    async def join(admission: Admission, tier: str) -> None:
        waiting[tier] += 1
        try:
            await admission.acquire("m", tenant=GOLD, tier=tier)
        finally:
            waiting[tier] -= 1
        held.append(tier)

    async def main() -> None:
        pool = _pool(("n", ("m",), 4))
        config = AdmissionConfig(max_queue=100, max_queue_per_key=100, policy=policy,
                                 priority_slots=kept)  # fmt: skip
        admission = Admission(pool, config, EdgeMetrics())
        state = pool.nodes[0]
        async with trio.open_nursery() as nursery:
            for op, arg in ops:
                running = held.count("priority")
                if op == "join":
                    nursery.start_soon(join, admission, TIERS[arg % 3])
                elif held:
                    held.pop(arg % len(held))
                    admission.release(state)
                await trio.testing.wait_all_tasks_blocked()
                free = 4 - state.in_flight
                assert state.in_flight == len(held)
                assert len(held) - held.count("priority") <= 4 - kept  # the kept slots
                if op == "join" and TIERS[arg % 3] == "priority" and running < kept:
                    assert not waiting["priority"]  # a priority request ran at once
                if waiting["priority"]:
                    assert free == 0
                if waiting["default"] or waiting["flex"]:
                    assert free <= kept  # a slot past the kept ones is never left idle
            nursery.cancel_scope.cancel()

    trio.run(main)


@given(
    st.sampled_from(["fair", "fifo"]),
    st.integers(0, 3),
    st.lists(st.tuples(st.sampled_from(["join", "release"]), st.integers(0, 20)), max_size=30),
)
def test_priority_slots_are_left_to_priority_requests(
    policy: str, kept: int, ops: list[tuple[str, int]]
) -> None:
    """With `priority_slots` kept, under either policy: default and flex requests never
    hold more than the other slots, a priority request finds a slot at once while fewer
    than the kept ones run priority, and no slot past the kept ones stays free while a
    default or flex request waits."""
    _reserve_run(policy, kept, ops)


async def test_a_default_request_waits_rather_than_take_the_kept_slot() -> None:
    """priority_slots 1 on 2 slots: the second default request waits with one slot free;
    a priority request takes it at once, and the default one runs once two are free."""
    pool = _pool(("n", ("m",), 2))
    admission = Admission(pool, AdmissionConfig(priority_slots=1), EdgeMetrics())
    first = await admission.acquire("m", tenant=FLOOD)
    got: list[str] = []
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_wait, admission, FLOOD, "default", got, errors, "default")
        await trio.testing.wait_all_tasks_blocked()
        assert (admission.depth, pool.nodes[0].in_flight) == (1, 1)
        node = await admission.acquire("m", tenant=GOLD, tier="priority")
        assert admission.depth == 1
        admission.release(first)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # the priority request holds one slot, the other is kept
        admission.release(node)
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["default"]
    assert pool.nodes[0].in_flight == 0
