"""The admission queue's fair policy under trio: tenants, tiers, shedding, the gauges.

As tests/unit/test_admission.py: a real `NodePool` whose node states the tests set by
hand, one node of one slot, requests that wait for it.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

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
