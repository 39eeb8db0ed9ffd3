"""The asyncio bridge (`edge.node.bridge`): a real asyncio loop in its thread, real trio.

`call_asyncio` returns, raises and is cancelled as an awaited trio call would be,
and never returns before its asyncio task is over; `read_into` moves a read loop's
events into an EventBuffer in order, whatever the two sides' paces, with the
Inbox's bound held on the asyncio side; a cancelled read loop is told whether
it settles, and nothing is left on the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from edge.node.bridge import (
    INBOX_EVENTS,
    EventBuffer,
    asyncio_loop,
    call_asyncio,
    read_into,
)
from edge.node.grpc import ACCEPTED, EventSink
from edge.stream.events import Complete, Delta


async def _tasks_left() -> int:
    me = asyncio.current_task()
    return sum(1 for task in asyncio.all_tasks() if task is not me)


async def test_call_asyncio_runs_on_the_loops_thread_and_returns_or_raises() -> None:
    async def where(x: int) -> tuple[str, int]:
        await asyncio.sleep(0)
        return threading.current_thread().name, x * 2

    async def fails() -> None:
        raise ValueError("boom")

    async with asyncio_loop():
        name, doubled = await call_asyncio(where, 21)
        assert doubled == 42
        assert name != threading.current_thread().name
        with pytest.raises(ValueError, match="boom"):
            await call_asyncio(fails)


async def test_a_trio_cancel_cancels_the_asyncio_task_and_waits_for_it() -> None:
    """The caller's cancel reaches the task; the call returns only once the task's own
    cleanup ran (nothing of it goes on after)."""
    cleaned: list[str] = []
    started = trio.Event()
    token = trio.lowlevel.current_trio_token()

    async def sleeper() -> None:
        token.run_sync_soon(started.set)
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)  # a cleanup that itself awaits
            cleaned.append("done")

    async with asyncio_loop():
        with trio.move_on_after(30) as scope:
            async with trio.open_nursery() as nursery:

                async def call() -> None:
                    await call_asyncio(sleeper)

                nursery.start_soon(call)
                await started.wait()
                nursery.cancel_scope.cancel()
        assert not scope.cancelled_caught
        assert cleaned == ["done"]
        assert await call_asyncio(_tasks_left) == 0


async def test_the_loop_closes_what_is_left_on_it() -> None:
    """Leaving the block cancels a task still running on the loop and joins the thread."""
    ended: list[str] = []

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append("cancelled")

    threads = threading.active_count()
    async with asyncio_loop():
        loop_task_started = trio.Event()
        token = trio.lowlevel.current_trio_token()

        async def spawn() -> None:
            asyncio.get_running_loop().create_task(forever())
            await asyncio.sleep(0)
            token.run_sync_soon(loop_task_started.set)

        await call_asyncio(spawn)
        await loop_task_started.wait()
    assert ended == ["cancelled"]
    assert threading.active_count() == threads


def _read_loop(
    items: list[Delta | Complete], *, pause_every: int
) -> Callable[[EventSink], Awaitable[None]]:
    async def read(sink: EventSink) -> None:
        if not sink.put_nowait(ACCEPTED):
            await sink.put(ACCEPTED)
        for i, item in enumerate(items):
            if not sink.put_nowait(item):
                await sink.put(item)
            if pause_every and i % pause_every == 0:
                await asyncio.sleep(0)

    return read


async def _consume(events: EventBuffer, every: int) -> list[object]:
    got: list[object] = []
    while True:
        try:
            got.append(await events.receive())
        except trio.EndOfChannel:
            return got
        if every and len(got) % every == 0:
            await trio.lowlevel.checkpoint()


@given(
    sizes=st.lists(st.integers(min_value=0, max_value=3000), min_size=0, max_size=300),
    producer_pause=st.integers(min_value=0, max_value=7),
    consumer_pause=st.integers(min_value=0, max_value=7),
    max_chars=st.sampled_from([16, 1000, 1 << 20]),
)
def test_read_into_moves_every_event_in_order_whatever_the_paces(
    sizes: list[int], producer_pause: int, consumer_pause: int, max_chars: int
) -> None:
    """Events arrive once each, in order, for any event sizes and any pace of either
    side, through buffers too small for them (both sides wait in turn)."""
    items: list[Delta | Complete] = [Delta("x" * n) for n in sizes] + [Complete()]

    async def main() -> list[object]:
        events = EventBuffer(max_events=8, max_chars=max_chars)
        async with asyncio_loop(), trio.open_nursery() as nursery:
            got: list[object] = []

            async def consume() -> None:
                got.extend(await _consume(events, consumer_pause))

            nursery.start_soon(consume)
            try:
                await read_into(
                    events, lambda: False, _read_loop(items, pause_every=producer_pause)
                )
            finally:
                events.close()
        return got

    got = trio.run(main)
    assert got == [ACCEPTED, *items]


async def test_the_inbox_holds_a_bounded_number_of_events_while_the_buffer_is_full() -> None:
    """Nobody reads: the EventBuffer fills, then the Inbox to its bound, and the read loop
    waits (its put does not return) rather than reading on."""
    events = EventBuffer(max_events=4, max_chars=1 << 20)
    sent: list[int] = []
    token = trio.lowlevel.current_trio_token()
    stuck = trio.Event()

    async def read(sink: EventSink) -> None:
        for i in range(10 * INBOX_EVENTS):
            if not sink.put_nowait(Delta(str(i))):
                token.run_sync_soon(stuck.set)
                await sink.put(Delta(str(i)))
            sent.append(i)

    async with asyncio_loop():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_into, events, lambda: False, read)
                await stuck.wait()
                await trio.testing.wait_all_tasks_blocked()
                # The read loop waits in `put` for room that cannot come: the read task
                # waits for room in the EventBuffer, which nobody reads.
                assert INBOX_EVENTS <= len(sent) <= 4 + 1 + INBOX_EVENTS
                nursery.cancel_scope.cancel()
        assert len(sent) <= 4 + 1 + INBOX_EVENTS
        assert await call_asyncio(_tasks_left) == 0


@pytest.mark.parametrize("settles", [True, False])
async def test_a_cancelled_read_loop_is_told_whether_it_settles(settles: bool) -> None:
    """The decision is taken on the trio side when the read task is cancelled, and
    the read loop sees it after its cancel; what it puts after is taken (a terminal
    noted) until it is over."""
    events = EventBuffer(max_events=64, max_chars=1 << 20)
    seen: list[bool] = []
    token = trio.lowlevel.current_trio_token()
    reading = trio.Event()

    async def read(sink: EventSink) -> None:
        sink.put_nowait(ACCEPTED)
        token.run_sync_soon(reading.set)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append(sink.settles())
            sink.put_nowait(Complete())  # the terminal that was on its way
            raise

    async with asyncio_loop():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_into, events, lambda: settles, read)
                await reading.wait()
                nursery.cancel_scope.cancel()
    assert seen == [settles]
    assert events.terminal


async def test_an_error_of_the_read_loop_reaches_the_read_task() -> None:
    events = EventBuffer(max_events=8, max_chars=100)

    async def read(sink: EventSink) -> None:
        sink.put_nowait(Delta("a"))
        raise ConnectionResetError("the node went away")

    async with asyncio_loop():
        with pytest.raises(ConnectionResetError):
            await read_into(events, lambda: False, read)
    assert events.receive_nowait() == Delta("a")
