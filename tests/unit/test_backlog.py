"""The process's backlog of output held for streams (`edge.node.backlog`).

Pure: waiters of the tests' own for the choice of victims; real EventBuffers
(trio memory channels, the asyncio bridge for a producer's wait) for what they
report, and a Run for the end a client that reads again sees; trio's MockClock
where the slow-client limit plays. Every kind of end of a real run, read task
included, is in tests/integration/test_backlog_e2e.py.
"""

from __future__ import annotations

import trio
import trio.testing

from edge.config import TimeoutsConfig
from edge.errors import NodeTimeoutError, OverloadedError
from edge.fleet.reader import SLOW_CLIENT_CUT, SLOW_CLIENT_NOTICE
from edge.node.backlog import BEYOND_BUFFER, Backlog
from edge.node.bridge import EventBuffer, asyncio_loop, call_asyncio
from edge.node.client import EndCause
from edge.stream.events import Complete, Delta, LogprobDelta, ReasoningDelta
from edge.stream.logprobs import TokenLogprob
from edge.stream.output import ContentOut, ErrorOut, RoleOut
from tests.unit.runkit import PlayedNode, RunKit


class _Held:
    """A buffer holding `chars` in the backlog; cut, it leaves it (as EventBuffer.cut)."""

    def __init__(self, backlog: Backlog, chars: int, cuts: list[_Held]) -> None:
        self._backlog, self._cuts, self.chars = backlog, cuts, chars
        backlog.chars += chars

    def cut(self) -> None:
        self._cuts.append(self)
        self._backlog.chars -= self.chars
        self.chars = 0


def test_the_longest_waiting_are_cut_first_until_the_total_is_under_the_budget() -> None:
    """Past the budget the waiters are cut in the order their waits began, each once, and
    no more of them than it takes to be under the budget again (equal is under)."""
    cuts: list[_Held] = []
    counted: list[None] = []
    backlog = Backlog(100, on_cut=lambda: counted.append(None))
    a, b, c = (_Held(backlog, 40, cuts) for _ in range(3))  # 120 held, nobody waits
    backlog.wait(a)  # over: a, the only waiter, is cut (80 left)
    assert (cuts, backlog.chars, backlog.waiting) == ([a], 80, 0)
    backlog.wait(b)
    backlog.wait(c)
    assert (cuts, backlog.waiting) == ([a], 2)
    d = _Held(backlog, 20, cuts)  # 100: at the budget, not past it
    backlog.over()
    assert cuts == [a]
    backlog.chars += 1  # past it by one character: the oldest waiter goes, not the newest
    backlog.over()
    assert (cuts, backlog.chars, backlog.waiting) == ([a, b], 61, 1)
    backlog.done_waiting(c)
    backlog.done_waiting(c)  # a second time is nothing
    assert (backlog.waiting, backlog.cuts, len(counted)) == (0, 2, 2)
    assert d.chars == 20


def test_a_waiter_counts_what_its_stream_holds_beyond_its_buffer() -> None:
    """Each producer adds `per_waiter` while it waits (once, however often it is told to
    wait) and takes it off when it stops or is cut: two waiters of 10 characters each
    at 30 per waiter pass a budget of 75, and cutting the older brings the total to 40."""
    cuts: list[_Held] = []
    backlog = Backlog(75, per_waiter=30)
    a, b = _Held(backlog, 10, cuts), _Held(backlog, 10, cuts)
    backlog.wait(a)
    backlog.wait(a)  # still one wait
    assert (backlog.chars, backlog.waiting, cuts) == (50, 1, [])
    backlog.wait(b)  # 90: past the budget, the older waiter goes with its 40
    assert (backlog.chars, backlog.waiting, cuts) == (40, 1, [a])
    backlog.done_waiting(a)  # cut already: nothing more to take off
    backlog.done_waiting(b)
    assert (backlog.chars, backlog.waiting) == (10, 0)


def test_the_extra_per_waiter_covers_the_node_hops_window() -> None:
    """What a waiter is counted beyond its buffer is at least the node hop's stream
    window, which grpclib fills with frames nobody decodes while the stream stalls."""
    from edge.node.grpc import STREAM_WINDOW

    assert BEYOND_BUFFER >= 2 * STREAM_WINDOW


def test_a_reader_is_never_cut_whatever_the_total() -> None:
    """A buffer whose producer is not waiting is no candidate: far past the budget with
    nobody waiting, nothing is cut and the reader's puts go on."""
    cuts: list[_Held] = []
    backlog = Backlog(10)
    reader = _Held(backlog, 1000, cuts)
    buffer = EventBuffer(max_events=16, max_chars=1000, backlog=backlog)
    assert buffer.put_nowait(Delta("a" * 500))
    assert buffer.put_nowait(Delta("b" * 500))
    assert (backlog.chars, backlog.cuts, cuts, buffer.cut_by_backlog) == (2000, 0, [], False)
    assert reader.chars == 1000


def test_a_buffer_counts_its_text_into_the_backlog_and_leaves_it_once() -> None:
    """Each buffer adds the text it takes in (deltas, reasoning, logprob entries) and takes
    off what its writer takes; `release` takes off the rest, once; after it the buffer's
    events no longer move the total."""
    backlog = Backlog()
    one = EventBuffer(max_events=16, max_chars=1000, backlog=backlog)
    two = EventBuffer(max_events=16, max_chars=1000, backlog=backlog)
    scored = LogprobDelta("cd", logprobs=(TokenLogprob("cd", -0.5),))
    assert one.put_nowait(Delta("a" * 10))
    assert one.put_nowait(scored)
    assert two.put_nowait(ReasoningDelta("b" * 5))
    assert two.put_nowait(Complete())
    assert backlog.chars == 10 + scored.size + 5
    assert one.receive_nowait() == Delta("a" * 10)
    assert backlog.chars == scored.size + 5
    one.release()
    assert backlog.chars == 5
    one.release()
    assert one.receive_nowait() == scored
    assert one.put_nowait(Delta("late"))
    assert backlog.chars == 5
    two.close()
    two.release()
    assert backlog.chars == 0
    two.clear()  # what is left is dropped, the total untouched
    assert (backlog.chars, two.held_chars) == (0, 0)


async def _wait_put(buffer: EventBuffer, item: Delta, outcome: list[BaseException | None]) -> None:
    """A producer that waits for room, as the node's read loop does (on the asyncio side)."""
    try:
        await call_asyncio(lambda: buffer.put(item))
        outcome.append(None)
    except (trio.TooSlowError, trio.BrokenResourceError) as exc:
        outcome.append(exc)


async def test_past_the_budget_the_producer_waiting_longest_is_cut_as_a_slow_client() -> None:
    """Two producers wait for room, then a reader's put passes the budget: the one that
    began waiting first gets trio.TooSlowError (the slow-client end) and its buffer leaves
    the backlog; the other keeps waiting, and goes on once its writer takes an event. The
    reader is not cut. Everything released, the total is 0."""
    backlog = Backlog(250)
    first, second, reader = (
        EventBuffer(max_events=16, max_chars=100, backlog=backlog) for _ in range(3)
    )
    outcomes: dict[str, list[BaseException | None]] = {"first": [], "second": []}
    async with asyncio_loop():
        with trio.fail_after(10):  # generous: only a bug waits this long
            async with trio.open_nursery() as nursery:
                assert first.put_nowait(Delta("a" * 100))
                nursery.start_soon(_wait_put, first, Delta("x"), outcomes["first"])
                await trio.testing.wait_all_tasks_blocked()
                assert second.put_nowait(Delta("b" * 100))
                nursery.start_soon(_wait_put, second, Delta("y"), outcomes["second"])
                await trio.testing.wait_all_tasks_blocked()
                assert (backlog.chars, backlog.waiting) == (200, 2)
                assert reader.put_nowait(Delta("r" * 40))  # 240: under
                assert backlog.cuts == 0
                assert reader.put_nowait(Delta("s" * 20))  # 260: the first waiter goes
                await trio.testing.wait_all_tasks_blocked()
                assert isinstance(outcomes["first"][0], trio.TooSlowError)
                assert first.cut_by_backlog
                assert not second.cut_by_backlog
                assert (backlog.chars, backlog.waiting, backlog.cuts) == (160, 1, 1)
                assert outcomes["second"] == []
                assert second.receive_nowait() == Delta("b" * 100)
    assert outcomes["second"] == [None]
    assert (backlog.chars, backlog.waiting) == (61, 0)
    for buffer in (first, second, reader):
        buffer.release()
    assert backlog.chars == 0


async def test_a_producer_that_waits_for_room_tells_the_stall() -> None:
    """`on_stall`'s callback hears False when the producer first waits for room (a client
    that keeps up never makes it wait; at once if registered after), and True if the
    backlog cuts the wait; a released buffer forgets it."""
    told: list[tuple[str, bool]] = []
    backlog = Backlog(150)
    buffer = EventBuffer(max_events=16, max_chars=100, backlog=backlog)
    buffer.on_stall(lambda cut: told.append(("early", cut)))
    assert buffer.put_nowait(Delta("a" * 60))
    assert buffer.receive_nowait() == Delta("a" * 60)
    assert buffer.put_nowait(Delta("b" * 100))
    assert told == []
    outcome: list[BaseException | None] = []
    async with asyncio_loop():
        with trio.fail_after(10):  # generous: only a bug waits this long
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_wait_put, buffer, Delta("c"), outcome)
                await trio.testing.wait_all_tasks_blocked()
                assert told == [("early", False)]
                assert buffer.receive_nowait() == Delta("b" * 100)
    assert outcome == [None]
    buffer.on_stall(lambda cut: told.append(("late", cut)))
    assert told == [("early", False), ("late", False)]
    assert buffer.put_nowait(Delta("d" * 99))
    async with asyncio_loop():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_wait_put, buffer, Delta("e" * 2), outcome)
                await trio.testing.wait_all_tasks_blocked()
                reader = EventBuffer(max_events=16, max_chars=100, backlog=backlog)
                assert reader.put_nowait(Delta("r" * 60))  # past the budget: cut
    assert told == [("early", False), ("late", False), ("late", True)]
    assert isinstance(outcome[-1], trio.TooSlowError)
    released = EventBuffer(max_events=16, max_chars=100)
    released.on_stall(lambda cut: told.append(("before release", cut)))
    released.release()  # forgets the callback it had
    released.on_stall(lambda cut: told.append(("after release", cut)))  # and takes none
    assert released.put_nowait(Delta("f" * 100))
    async with asyncio_loop():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_wait_put, released, Delta("g"), outcome)
                await trio.testing.wait_all_tasks_blocked()
                released.receive_nowait()
    assert len(told) == 3


async def test_a_producer_that_comes_to_wait_past_the_budget_is_cut_at_once() -> None:
    """The total is past the budget when the only producer starts to wait: it is cut
    before it parks (no waiting in a process already over its budget)."""
    backlog = Backlog(50)
    buffer = EventBuffer(max_events=16, max_chars=100, backlog=backlog)
    outcome: list[BaseException | None] = []
    assert buffer.put_nowait(Delta("a" * 100))
    async with asyncio_loop():
        with trio.fail_after(10):
            await _wait_put(buffer, Delta("x"), outcome)
    assert isinstance(outcome[0], trio.TooSlowError)
    assert buffer.cut_by_backlog
    assert (backlog.chars, backlog.waiting, backlog.cuts) == (0, 0, 1)


async def test_the_slow_client_limit_still_ends_a_wait_under_the_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Under the budget, a producer waits until `limit_s` and gets trio.TooSlowError as
    before, not counted as a cut; it is no waiter of the backlog after."""
    backlog = Backlog(10_000)
    buffer = EventBuffer(max_events=16, max_chars=100, limit_s=30, backlog=backlog)
    outcome: list[BaseException | None] = []
    assert buffer.put_nowait(Delta("a" * 100))
    async with asyncio_loop():
        start = trio.current_time()
        await _wait_put(buffer, Delta("x"), outcome)
        assert trio.current_time() - start >= 30
    assert isinstance(outcome[0], trio.TooSlowError)
    assert not buffer.cut_by_backlog
    assert (backlog.chars, backlog.waiting, backlog.cuts) == (100, 0, 0)


async def _slow_client_end(*, cut: bool) -> list[object]:
    """What a stream's writer gives a client that reads again after its run ended as a
    slow client (by the budget when `cut`), the events it had not taken dropped."""
    node = PlayedNode(max_chars=100)
    run = (await RunKit(TimeoutsConfig(), node).run()).reader
    handle, events = node.handle, node.events
    assert events.put_nowait(Delta("taken"))
    assert await run.next_batch() == [RoleOut()]
    assert await run.next_batch() == [ContentOut("taken")]
    assert events.put_nowait(Delta("dropped"))
    events.cut_by_backlog = cut
    handle.cancel(EndCause.SLOW_CLIENT)  # as the read task does, then its cleanup:
    events.release()
    events.close()
    events.clear()
    out: list[object] = []
    while batch := await run.next_batch():
        assert isinstance(batch, list)
        out += batch
    return out


async def test_a_stream_cut_by_the_budget_ends_with_an_overloaded_frame() -> None:
    """A client that reads again after the budget cut its run gets no more of its output
    (dropped when the run ended) and an `overloaded` error frame as its stream's end; one
    ended by slow_client_s gets a `timeout` frame."""
    assert await _slow_client_end(cut=True) == [ErrorOut(OverloadedError.type, SLOW_CLIENT_CUT)]
    assert await _slow_client_end(cut=False) == [
        ErrorOut(NodeTimeoutError.type, SLOW_CLIENT_NOTICE)
    ]
