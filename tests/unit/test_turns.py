"""Heavy steps take turns: at most `per_pass` per scheduler pass, the rest in order."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from edge.turns import Turns


async def _pass_marker(passes: list[int], stop: trio.Event) -> None:
    """Counts scheduler passes: runs once in each (it is always runnable)."""
    n = 0
    while not stop.is_set():
        n += 1
        passes.append(n)
        await trio.lowlevel.checkpoint()


def test_per_pass_must_be_positive() -> None:
    with pytest.raises(ValueError, match="per_pass"):
        Turns(0)


async def test_a_turn_under_the_budget_returns_without_yielding() -> None:
    turns = Turns(2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(turns.run)
        with trio.testing.assert_no_checkpoints():
            await turns.turn()
            await turns.turn()
        assert turns.deferred == 0
        nursery.cancel_scope.cancel()


async def test_at_most_per_pass_turns_in_one_pass_the_rest_in_arrival_order() -> None:
    turns = Turns(3)
    got_at: dict[int, int] = {}
    passes: list[int] = []
    stop = trio.Event()

    async def step(i: int) -> None:
        await turns.turn()
        got_at[i] = passes[-1]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turns.run)
        nursery.start_soon(_pass_marker, passes, stop)
        await trio.lowlevel.checkpoint()
        async with trio.open_nursery() as steps:
            for i in range(30):  # all runnable in the same pass
                steps.start_soon(step, i)
        stop.set()
        nursery.cancel_scope.cancel()
    assert len(got_at) == 30
    assert turns.deferred >= 30 - 2 * turns.per_pass
    given: dict[int, int] = {}
    for at in got_at.values():
        given[at] = given.get(at, 0) + 1
    # Never more than the pass's own budget plus the waiting steps it woke.
    assert max(given.values()) <= 2 * turns.per_pass
    assert len(given) >= 30 // (2 * turns.per_pass)


async def test_waiting_steps_get_their_turns_first_come_first_served() -> None:
    turns = Turns(1)
    order: list[int] = []

    async def step(i: int, ready: trio.Event) -> None:
        ready.set()
        await turns.turn()
        order.append(i)

    async with trio.open_nursery() as nursery:
        await turns.turn()  # the budget is spent, and no pacer renews it yet: all wait
        async with trio.open_nursery() as steps:
            for i in range(6):
                ready = trio.Event()
                steps.start_soon(step, i, ready)
                await ready.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert turns.waiting == 6
            nursery.start_soon(turns.run)
        nursery.cancel_scope.cancel()
    assert order == list(range(6))


async def test_a_step_cancelled_while_waiting_gives_its_turn_to_the_next() -> None:
    turns = Turns(1)
    done: list[str] = []

    async def step(name: str, ready: trio.Event) -> None:
        ready.set()
        await turns.turn()
        done.append(name)

    async with trio.open_nursery() as nursery:
        await turns.turn()  # the budget is spent, and no pacer renews it yet: both wait
        async with trio.open_nursery() as steps:
            gone = trio.CancelScope()
            ready = trio.Event()
            steps.start_soon(_in_scope, gone, step, "gone", ready)
            await ready.wait()
            ready = trio.Event()
            steps.start_soon(step, "next", ready)
            await ready.wait()
            await trio.testing.wait_all_tasks_blocked()
            gone.cancel()
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(turns.run)
        nursery.cancel_scope.cancel()
    assert done == ["next"]


async def _in_scope(
    scope: trio.CancelScope, fn: Callable[..., Awaitable[None]], *args: object
) -> None:
    with scope:
        await fn(*args)


async def test_the_pacer_sleeps_when_nobody_asks_for_turns() -> None:
    """Idle, the pacer waits on an event: the scheduler can block (no busy loop)."""
    turns = Turns(2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(turns.run)
        for _ in range(5):
            await turns.turn()
        # wait_all_tasks_blocked returns only once every task (the pacer too) waits.
        with trio.fail_after(5):
            await trio.testing.wait_all_tasks_blocked()
        assert turns.waiting == 0
        nursery.cancel_scope.cancel()


async def test_each_step_that_waits_is_reported() -> None:
    """`on_defer` (the edge's iop_edge_deferred_steps_total) hears of every wait."""
    reported: list[None] = []
    turns = Turns(1, on_defer=lambda: reported.append(None))
    await turns.turn()  # the budget is spent, and no pacer renews it yet
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(turns.turn)
        await trio.testing.wait_all_tasks_blocked()
        assert len(reported) == turns.deferred == 3
        nursery.start_soon(turns.run)
        with trio.fail_after(5):
            while turns.waiting:  # the scheduler's passes drain it
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
