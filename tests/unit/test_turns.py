"""Heavy steps take turns: at most `per_pass` per scheduler pass, the rest in order."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from edge.fleet.turns import Turns


class _Passes(trio.abc.Instrument):
    """Counts scheduler passes exactly: trio calls `after_io_wait` once per pass, before
    any task of that pass runs."""

    def __init__(self) -> None:
        self.n = 0

    def after_io_wait(self, timeout: float) -> None:
        self.n += 1


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
        assert turns.waiting == 0
        nursery.cancel_scope.cancel()


async def test_at_most_per_pass_turns_in_one_pass() -> None:
    """30 steps runnable in the same pass get their turns 3 per pass, none lost."""
    deferred: list[None] = []
    turns = Turns(3, on_defer=lambda: deferred.append(None))
    passes = _Passes()
    got_in: dict[int, int] = {}

    async def step(i: int) -> None:
        await turns.turn()
        got_in[i] = passes.n

    trio.lowlevel.add_instrument(passes)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(turns.run)
            await trio.lowlevel.checkpoint()
            async with trio.open_nursery() as steps:
                for i in range(30):  # all runnable in the same pass
                    steps.start_soon(step, i)
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(passes)
    assert len(got_in) == 30
    assert len(deferred) == 30 - turns.per_pass  # the first pass's budget, then waits
    given: dict[int, int] = {}
    for at in got_in.values():
        given[at] = given.get(at, 0) + 1
    assert max(given.values()) == turns.per_pass
    assert len(given) == 30 // turns.per_pass


async def test_waiting_steps_get_their_turns_first_come_first_served() -> None:
    turns = Turns(1)
    order: list[int] = []

    async def step(i: int, ready: trio.Event) -> None:
        ready.set()
        await turns.turn()
        order.append(i)

    async with trio.open_nursery() as nursery:
        await turns.turn()  # the budget is spent, and run() is not renewing it yet: all wait
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
        await turns.turn()  # the budget is spent, and run() is not renewing it yet: both wait
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


async def test_run_sleeps_when_nobody_waits() -> None:
    """With no step waiting, `run()` waits on an event: the scheduler can block in its
    I/O wait (no task runnable every pass, no busy loop)."""
    turns = Turns(2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(turns.run)
        for _ in range(5):
            await turns.turn()
        # wait_all_tasks_blocked returns only once every task (run() too) waits.
        with trio.fail_after(5):
            await trio.testing.wait_all_tasks_blocked()
        assert turns.waiting == 0
        nursery.cancel_scope.cancel()


async def test_each_step_that_waits_is_reported() -> None:
    """`on_defer` (the edge's iop_edge_deferred_steps_total) hears of every wait."""
    reported: list[None] = []
    turns = Turns(1, on_defer=lambda: reported.append(None))
    await turns.turn()  # the budget is spent, and run() is not renewing it yet
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(turns.turn)
        await trio.testing.wait_all_tasks_blocked()
        assert len(reported) == turns.waiting == 3
        nursery.start_soon(turns.run)
        with trio.fail_after(5):
            while turns.waiting:  # the scheduler's passes drain it
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
