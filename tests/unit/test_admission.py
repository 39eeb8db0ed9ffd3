"""The admission queue under trio's MockClock: slots, FIFO order, shedding, leaving.

The pool is a real `NodePool` whose node states the tests set by hand (no
node is contacted: admission only reads states and counts slots).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from edge.config import AdmissionConfig, RoutingConfig
from edge.errors import NodeUnavailableError, OverloadedError, PayloadTooLargeError
from edge.fleet.admission import SCAN, Admission
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.fleet.tenants import Tenant
from edge.node.client import NodeDescription
from edge.observe.metrics import EdgeMetrics


class _Client:
    """Just enough of a NodeClient for the pool's bookkeeping."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.address = name

    async def describe(self) -> NodeDescription:  # pragma: no cover - never refreshed here
        raise AssertionError("not contacted")


def _pool(*nodes: tuple[str, tuple[str, ...], float]) -> NodePool:
    pool = NodePool([_Client(name) for name, _, _ in nodes])  # type: ignore[list-item]
    for state, (name, models, max_runs) in zip(pool.nodes, nodes, strict=True):
        pool.feed.described(state, NodeDescription(name, models))
        state.max_runs = max_runs
    return pool


def _admission(
    pool: NodePool, max_queue: int = 3, queue_timeout_s: float = 30
) -> tuple[Admission, EdgeMetrics]:
    metrics = EdgeMetrics()
    return Admission(pool, AdmissionConfig(max_queue, queue_timeout_s), metrics), metrics


def _sample(metrics: EdgeMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def _queue(
    admission: Admission,
    model: str,
    got: list[tuple[str, NodeState]],
    tag: str,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Acquire a slot for `model`; note `tag` and the node in `got` in the order served."""
    depth = admission.depth
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_acquire, admission, model, got, tag)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.depth == depth + 1  # it waits
        task_status.started()


async def _acquire(
    admission: Admission, model: str, got: list[tuple[str, NodeState]], tag: str
) -> None:
    got.append((tag, await admission.acquire(model)))


async def test_free_slots_are_taken_at_once_and_counted() -> None:
    """A node with a free slot is taken at once: its in_flight counts the slot; release
    gives it back."""
    pool = _pool(("n", ("m",), 2))
    admission, _ = _admission(pool)
    first = await admission.acquire("m")
    second = await admission.acquire("m")
    assert first is second is pool.nodes[0]
    assert pool.nodes[0].in_flight == 2
    admission.release(first)
    assert pool.nodes[0].in_flight == 1


async def test_waiters_are_served_in_order_one_per_release(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With every slot taken, requests wait; each release wakes exactly the oldest waiter
    (with the slot already taken for it), the others keep waiting; the depth gauge and the
    wait histogram follow."""
    pool = _pool(("n", ("m",), 1))
    admission, metrics = _admission(pool)
    node = await admission.acquire("m")
    got: list[tuple[str, NodeState]] = []
    async with trio.open_nursery() as nursery:
        for tag in "abc":
            await nursery.start(_queue, admission, "m", got, tag)
        assert _sample(metrics, "iop_edge_queue_depth", tier="default") == 3
        for served in ("a", "b", "c"):
            admission.release(node)
            await trio.testing.wait_all_tasks_blocked()
            assert [tag for tag, _ in got] == list("abc"[: "abc".index(served) + 1])
            assert pool.nodes[0].in_flight == 1  # handed over, not raced for
            node = got[-1][1]
    assert admission.depth == 0
    assert _sample(metrics, "iop_edge_queue_depth", tier="default") == 0
    assert _sample(metrics, "iop_edge_queue_seconds_count") == 3


async def test_a_full_queue_sheds_at_once() -> None:
    """max_queue waiting: the next request is OverloadedError at once (503, Retry-After),
    counted as shed queue_full; nothing is queued for it."""
    pool = _pool(("n", ("m",), 1))
    admission, metrics = _admission(pool, max_queue=2)
    await admission.acquire("m")
    got: list[tuple[str, NodeState]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(_queue, admission, "m", got, "a")
        await nursery.start(_queue, admission, "m", got, "b")
        with pytest.raises(OverloadedError) as caught:
            await admission.acquire("m")
        assert caught.value.status == 503
        assert caught.value.to_dict()["error"]["code"] == "overloaded"
        assert caught.value.retry_after_s >= 1
        assert admission.depth == 2
        nursery.cancel_scope.cancel()
    assert _sample(metrics, "iop_edge_shed_total", reason="queue_full", tier="default") == 1


@pytest.mark.parametrize("policy", ["fifo", "fair"])
async def test_a_full_queue_sheds_before_the_parse_only_when_no_slot_is_free(policy: str) -> None:
    """shed_if_full: with the queue full and every node's slots taken, a request is shed
    before it is parsed; with a slot free anywhere (another model's node), it is not.
    Under the fair policy only once its tenant is known: whom a fair queue sheds depends
    on whose the request is."""
    pool = _pool(("n", ("m",), 1), ("o", ("other",), 1))
    metrics = EdgeMetrics()
    admission = Admission(pool, AdmissionConfig(max_queue=1, policy=policy), metrics)
    tenant = Tenant("t") if policy == "fair" else None
    await admission.acquire("m")
    got: list[tuple[str, NodeState]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(_queue, admission, "m", got, "a")
        admission.shed_if_full(tenant)  # node "o" has a free slot: "other" may run
        await admission.acquire("other")
        if policy == "fair":
            admission.shed_if_full()  # whose it is unknown: not shed yet
        with pytest.raises(OverloadedError):
            admission.shed_if_full(tenant)
        nursery.cancel_scope.cancel()
    assert _sample(metrics, "iop_edge_shed_total", reason="queue_full", tier="unknown") == 1


async def test_a_wait_past_the_timeout_is_shed(autojump_clock: trio.testing.MockClock) -> None:
    """No slot within queue_timeout_s: OverloadedError, counted as shed queue_timeout, and
    the request has left the queue."""
    pool = _pool(("n", ("m",), 1))
    admission, metrics = _admission(pool, queue_timeout_s=5)
    await admission.acquire("m")
    start = trio.current_time()
    with pytest.raises(OverloadedError):
        await admission.acquire("m")
    assert trio.current_time() - start == 5
    assert admission.depth == 0
    assert _sample(metrics, "iop_edge_shed_total", reason="queue_timeout", tier="default") == 1


async def test_a_waiter_that_leaves_takes_no_slot() -> None:
    """A request cancelled while queued (its client left) leaves the queue; the slot
    released later goes to the next waiter, never to it."""
    pool = _pool(("n", ("m",), 1))
    admission, _ = _admission(pool)
    node = await admission.acquire("m")
    got: list[tuple[str, NodeState]] = []
    leaving = trio.CancelScope()

    async def leaver() -> None:
        with leaving:
            await _acquire(admission, "m", got, "leaves")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leaver)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_acquire, admission, "m", got, "stays")
        await trio.testing.wait_all_tasks_blocked()
        leaving.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert admission.depth == 1
        admission.release(node)
    assert got == [("stays", pool.nodes[0])]
    assert pool.nodes[0].in_flight == 1


async def test_a_slot_handed_as_the_client_leaves_is_given_back() -> None:
    """A waiter handed a slot in the same instant its client left gives the slot back, and
    the next waiter gets it."""
    pool = _pool(("n", ("m",), 1))
    admission, _ = _admission(pool)
    node = await admission.acquire("m")
    got: list[tuple[str, NodeState]] = []
    leaving = trio.CancelScope()

    async def leaver() -> None:
        with leaving:
            await _acquire(admission, "m", got, "leaves")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leaver)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_acquire, admission, "m", got, "next")
        await trio.testing.wait_all_tasks_blocked()
        leaving.cancel()  # its client leaves...
        admission.release(node)  # ...as the slot is handed to it, before it runs again
    assert got == [("next", pool.nodes[0])]
    assert pool.nodes[0].in_flight == 1


async def test_a_waiter_for_a_busy_model_does_not_hold_up_another_model() -> None:
    """Two nodes serving different models, both full: a slot freed on the second goes to
    the first waiter for its model, past an older waiter for the other model."""
    pool = _pool(("x", ("mx",), 1), ("y", ("my",), 1))
    admission, _ = _admission(pool)
    await admission.acquire("mx")
    node_y = await admission.acquire("my")
    got: list[tuple[str, NodeState]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(_queue, admission, "mx", got, "wants-x")
        await nursery.start(_queue, admission, "my", got, "wants-y")
        admission.release(node_y)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [("wants-y", pool.nodes[1])]
        assert admission.depth == 1
        nursery.cancel_scope.cancel()


async def test_on_available_hands_out_every_free_slot() -> None:
    """The pool says a node may take runs again (here: its limit raised): as many waiters
    as there are free slots are woken, in order."""
    pool = _pool(("n", ("m",), 1))
    admission, _ = _admission(pool, max_queue=10)
    await admission.acquire("m")
    got: list[tuple[str, NodeState]] = []
    async with trio.open_nursery() as nursery:
        for tag in "abcd":
            await nursery.start(_queue, admission, "m", got, tag)
        pool.nodes[0].max_runs = 4
        assert pool.on_available is not None
        pool.on_available()
        await trio.testing.wait_all_tasks_blocked()
        # Handed out in queue order (the woken tasks may run in any order).
        assert sorted(tag for tag, _ in got) == ["a", "b", "c"]
        assert admission.depth == 1
        nursery.cancel_scope.cancel()


async def test_a_waiter_whose_model_cannot_be_served_any_more_is_told() -> None:
    """While queued, the breaker of every node serving the model opened (a node that is
    only down would still be tried: panic routing): the waiter gets the pool's error
    (503 node_unavailable), not a wait to its timeout."""
    pool = _pool(("n", ("m",), 1))
    admission, _ = _admission(pool)
    node = await admission.acquire("m")
    errors: list[BaseException] = []

    async def wait() -> None:
        try:
            await admission.acquire("m")
        except NodeUnavailableError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(RoutingConfig().breaker_failures):
            pool.run_failed(pool.nodes[0], "error_event")
        admission.release(node)
    assert len(errors) == 1


async def test_a_release_costs_a_bounded_number_of_picks() -> None:
    """1,000 waiters for one model: a release picks at most twice (the woken waiter's
    pick, and one that finds the node full again), never once per waiter."""
    pool = _pool(("n", ("m",), 1))
    admission, _ = _admission(pool, max_queue=1000)
    node = await admission.acquire("m")
    picks = 0
    pick = pool.pick

    def counting_pick(*args: object, **kwargs: object) -> NodeState | None:
        nonlocal picks
        picks += 1
        return pick(*args, **kwargs)  # type: ignore[arg-type]

    got: list[tuple[str, NodeState]] = []
    async with trio.open_nursery() as nursery:
        for i in range(1000):
            nursery.start_soon(_acquire, admission, "m", got, str(i))
        await trio.testing.wait_all_tasks_blocked()
        assert admission.depth == 1000
        pool.pick = counting_pick  # type: ignore[method-assign]
        admission.release(node)
        await trio.testing.wait_all_tasks_blocked()
        assert picks <= 2 < SCAN
        assert len(got) == 1
        assert admission.depth == 999
        nursery.cancel_scope.cancel()


async def test_a_newcomer_does_not_pass_a_waiter_to_a_free_slot() -> None:
    """A slot that freed up without a release (the node's limit was raised, and nobody
    said so) goes to the request that waited, not to the one that just arrived."""
    pool = _pool(("n", ("m",), 1))
    admission, _ = _admission(pool)
    await admission.acquire("m")
    got: list[tuple[str, NodeState]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(_queue, admission, "m", got, "waited")
        pool.nodes[0].max_runs = 2
        nursery.start_soon(_acquire, admission, "m", got, "newcomer")
        await trio.testing.wait_all_tasks_blocked()
        assert [tag for tag, _ in got] == ["waited"]
        assert admission.depth == 1  # the newcomer waits its turn
        nursery.cancel_scope.cancel()


# --- the memory budget ---------------------------------------------------------------


def _budgeted(budget: int) -> tuple[Admission, EdgeMetrics]:
    metrics = EdgeMetrics()
    config = AdmissionConfig(memory_budget_bytes=budget)
    return Admission(_pool(("n", ("m",), 1)), config, metrics), metrics


async def test_the_memory_budget_sheds_what_would_pass_it_and_takes_back_once() -> None:
    """Bytes are taken while the budget has them; a request that would pass it is shed
    (503 overloaded, Retry-After, the amounts named) and takes nothing; each give-back
    returns its bytes once, whatever calls it twice; the gauge follows, back to 0."""
    MiB = 2**20
    admission, metrics = _budgeted(10 * MiB)
    first = admission.hold(6 * MiB)
    second = admission.hold(4 * MiB)
    assert admission.held == 10 * MiB
    assert _sample(metrics, "iop_edge_request_memory_bytes") == 10 * MiB
    with pytest.raises(OverloadedError) as shed:
        admission.hold(1)
    assert shed.value.status == 503
    assert shed.value.type == "overloaded"
    assert shed.value.retry_after_s >= 1
    assert "10 MiB of its 10 MiB memory budget" in shed.value.message
    assert _sample(metrics, "iop_edge_shed_total", reason="memory_budget", tier="unknown") == 1
    assert admission.held == 10 * MiB
    first()
    first()  # a second call gives nothing back
    assert admission.held == 4 * MiB
    third = admission.hold(6 * MiB)
    second()
    third()
    assert admission.held == 0
    assert _sample(metrics, "iop_edge_request_memory_bytes") == 0


async def test_a_request_larger_than_the_whole_budget_is_a_413() -> None:
    """A request that could never fit is told so (413, not a 503 to retry forever), and
    takes nothing."""
    admission, _ = _budgeted(2**20)
    with pytest.raises(PayloadTooLargeError) as refused:
        admission.hold(2**20 + 1)
    assert refused.value.status == 413
    assert "more than the edge's whole budget of 1 MiB" in refused.value.message
    assert admission.held == 0
    admission.hold(2**20)()  # exactly the budget fits
    assert admission.held == 0
