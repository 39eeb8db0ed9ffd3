"""The simulated node's queue (`edge.nodes.sim.server.Places`): who plays, who waits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.sim.server import Places, SimNode


def _run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def test_no_cap_never_waits() -> None:
    """With cap 0 every run plays at once and nothing waits."""

    async def scenario() -> None:
        places = Places(0)
        for _ in range(1000):
            await places.take(lambda: pytest.fail("waited"))
        assert (places.playing, places.waiting) == (1000, 0)

    _run(scenario)


def test_runs_past_the_cap_wait_and_play_in_order() -> None:
    """Past the cap runs wait (each told once), and each place given back goes to the
    first run waiting, never to a newcomer."""

    async def scenario() -> None:
        places = Places(2)
        waits: list[str] = []
        order: list[str] = []

        async def run(name: str) -> None:
            await places.take(lambda: waits.append(name))
            order.append(name)

        tasks = [asyncio.create_task(run(f"r{i}")) for i in range(5)]
        await asyncio.sleep(0)
        assert (places.playing, places.waiting, order) == (2, 3, ["r0", "r1"])
        assert waits == ["r2", "r3", "r4"]
        places.give_back()
        places.give_back()
        await asyncio.sleep(0)
        assert (places.playing, places.waiting, order) == (2, 1, ["r0", "r1", "r2", "r3"])
        places.give_back()
        await asyncio.gather(*tasks)
        places.give_back()
        places.give_back()
        assert (places.playing, places.waiting, order[-1]) == (0, 0, "r4")

    _run(scenario)


def test_a_stopped_waiting_run_leaves_the_queue() -> None:
    """A waiting run that is cancelled leaves the queue; the place later given back goes
    to the next run, not to the one that left."""

    async def scenario() -> None:
        places = Places(1)
        await places.take(lambda: None)
        order: list[str] = []

        async def run(name: str) -> None:
            await places.take(lambda: None)
            order.append(name)

        first, second = asyncio.create_task(run("a")), asyncio.create_task(run("b"))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert (places.playing, places.waiting) == (1, 1)
        places.give_back()
        await second
        assert order == ["b"]
        assert (places.playing, places.waiting) == (1, 0)

    _run(scenario)


def test_a_run_stopped_as_it_is_handed_a_place_passes_it_on() -> None:
    """A run cancelled just as a place was handed to it passes the place to the next
    run waiting: no place is lost."""

    async def scenario() -> None:
        places = Places(1)
        await places.take(lambda: None)
        first = asyncio.create_task(places.take(lambda: None))
        second = asyncio.create_task(places.take(lambda: None))
        await asyncio.sleep(0)
        places.give_back()  # the place goes to `first`...
        first.cancel()  # ...which is stopped before it runs again
        await asyncio.gather(first, return_exceptions=True)
        await second
        assert (places.playing, places.waiting) == (1, 0)

    _run(scenario)


def test_stopped_waiters_do_not_pile_up() -> None:
    """Thousands of waiting runs started and stopped leave the queue's memory bounded by
    the runs still waiting, not by all those that ever waited."""

    async def scenario() -> None:
        places = Places(1)
        await places.take(lambda: None)
        for _ in range(5000):
            task = asyncio.create_task(places.take(lambda: None))
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert places.waiting == 0
        assert len(places._queue) <= 16

    _run(scenario)


def test_a_negative_cap_is_refused() -> None:
    """max_runs below 0 is an error naming it."""
    with pytest.raises(ValueError, match="max_runs"):
        Places(-1)


class _Watched(SimNode):
    """A simulated node that records its load at each `state_changed`."""

    def __init__(self, max_runs: int) -> None:
        super().__init__(max_runs=max_runs)
        self.seen: list[tuple[int, int]] = []

    def state_changed(self) -> None:
        self.seen.append((self.places.playing, self.places.waiting))


def test_every_change_of_the_queue_is_told() -> None:
    """The node calls state_changed when a run starts playing, starts waiting, and when a
    waiting run leaves the queue: what Watch reports never lags the queue."""

    async def scenario() -> None:
        node = _Watched(max_runs=1)
        request = pb.RunRequest(run_id="r", model="sim-echo")
        await node.hold(request)
        assert node.seen[-1] == (1, 0)
        waiting = asyncio.create_task(node.hold(request))
        await asyncio.sleep(0)
        assert node.seen[-1] == (1, 1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert node.seen[-1] == (1, 0)
        await node.aclose()

    _run(scenario)
