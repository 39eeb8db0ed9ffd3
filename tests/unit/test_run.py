"""A Run's deadlines under trio's MockClock: no test here takes real time.

A Run drives one session from its run's event channel (its `reader`). These
tests open real runs (tests/unit/runkit.py) on a node they play, feeding the
run's channel themselves, and let the autojump clock run the deadlines:
first event, idle, total, keep-alives, and an event that waited in the
buffer while the writer was busy.
"""

from __future__ import annotations

import trio
import trio.testing

from edge.config import TimeoutsConfig
from edge.fleet.answer import Answer
from edge.fleet.reader import MAX_BATCH_CHARS, RunReader
from edge.fleet.run import Run
from edge.node.bridge import EventBuffer, asyncio_loop, call_asyncio
from edge.node.client import EndCause, RunHandle
from edge.stream.events import (
    LOGPROB_ENTRY_CHARS,
    Complete,
    Delta,
    Failed,
    LogprobDelta,
    NodeEvent,
)
from edge.stream.logprobs import TokenLogprob, TopLogprob
from edge.stream.output import ContentOut, ErrorOut, FinishOut, OutEvent, RoleOut
from edge.stream.session import SLICE_CHARS, SessionSettings
from tests.unit.runkit import PlayedNode, RunKit

TIMEOUTS = TimeoutsConfig(first_event_s=10, idle_s=5, total_s=60)


class _Sender:
    """The node side of a run's EventBuffer, as these tests drive it."""

    def __init__(self, events: EventBuffer) -> None:
        self._events = events

    def send_nowait(self, event: NodeEvent) -> None:
        assert self._events.put_nowait(event)


async def _stream_run(keepalive_s: float = 0.0) -> tuple[Run, _Sender]:
    node = PlayedNode()
    run = await RunKit(TIMEOUTS, node).run(keepalive_s=keepalive_s)
    return run, _Sender(node.events)


async def _stream(keepalive_s: float = 0.0) -> tuple[RunReader, _Sender]:
    run, send = await _stream_run(keepalive_s)
    return run.reader, send


async def test_first_event_timeout(autojump_clock: trio.testing.MockClock) -> None:
    """No event within first_event_s: a `timeout` frame naming the first token, the run
    cancelled with reason "timeout", the session's outcome `timeout`."""
    run, _send = await _stream()
    start = trio.current_time()
    assert await run.next_batch() == [RoleOut()]
    batch = await run.next_batch()
    assert trio.current_time() - start == TIMEOUTS.first_event_s
    assert batch == [ErrorOut("timeout", "timed out waiting for the first token")]
    assert run.handle is not None
    assert run.handle.cause is EndCause.TIMEOUT
    assert str(run.handle.cause) == "timeout"  # CancelRun's reason
    assert run.session.outcome is not None
    assert run.session.outcome.status == "timeout"


async def test_keepalives_only_before_the_first_event(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """While the first event is awaited, "keepalive" comes every keepalive_s; the first
    event stops them, and the first-event deadline still counts from dispatch."""
    run, send = await _stream(keepalive_s=3)
    start = trio.current_time()
    await run.next_batch()
    assert await run.next_batch() == "keepalive"
    assert trio.current_time() - start == 3
    assert await run.next_batch() == "keepalive"
    send.send_nowait(Delta("hi"))
    assert await run.next_batch() == [ContentOut("hi")]
    assert run.first_event_at == start + 6
    batch = await run.next_batch()  # idle from here: no more keep-alives
    assert batch == [ErrorOut("timeout", "timed out waiting for the next token")]
    assert trio.current_time() - start == 6 + TIMEOUTS.idle_s


async def test_total_timeout_wins_over_a_steady_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A node that sends a token every idle_s - 1 never trips the idle deadline, but the
    total deadline ends the stream."""
    run, send = await _stream()
    start = trio.current_time()
    await run.next_batch()
    batch: object = []
    while not run.session.terminated:
        await trio.sleep(TIMEOUTS.idle_s - 1)
        send.send_nowait(Delta("."))
        batch = await run.next_batch()
    assert batch == [ErrorOut("timeout", "timed out waiting for the run to finish")]
    assert trio.current_time() - start >= TIMEOUTS.total_s


async def test_a_buffered_event_is_taken_after_the_idle_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Events that waited in the buffer while the writer was busy (a slow reader) are
    taken, whatever the idle clock says: the node was not silent."""
    run, send = await _stream()
    await run.next_batch()
    send.send_nowait(Delta("a"))
    assert await run.next_batch() == [ContentOut("a")]
    send.send_nowait(Delta("b"))
    send.send_nowait(Complete())
    await trio.sleep(TIMEOUTS.idle_s * 3)  # the writer was stuck this long
    assert await run.next_batch() == [ContentOut("b"), FinishOut("stop", None)]
    assert run.session.outcome is not None
    assert run.session.outcome.status == "success"


async def test_event_buffer_is_bounded_in_characters() -> None:
    """The buffer refuses an event once its delta text would pass max_chars (the node's
    read loop then waits), takes events again once the writer took some, and lets one
    delta larger than the bound through alone."""
    events = EventBuffer(max_events=16, max_chars=100)
    assert events.put_nowait(Delta("a" * 60))
    assert not events.put_nowait(Delta("b" * 60))
    assert events.held_chars == 60
    assert events.receive_nowait() == Delta("a" * 60)
    assert events.held_chars == 0
    assert events.put_nowait(Delta("b" * 60))
    events.receive_nowait()
    assert events.put_nowait(Delta("c" * 500))
    assert not events.put_nowait(Delta("d"))
    assert events.held_chars == 500


async def test_event_buffer_counts_logprobs_against_its_bound() -> None:
    """A delta with logprobs counts its text and LOGPROB_ENTRY_CHARS per entry (a token or
    an alternative), given back when taken: a node's logprobs cannot grow the buffer past
    its bound while the text stays small."""
    token = TokenLogprob("a", -1.0, None, (TopLogprob("a", -1.0), TopLogprob("b", -2.0)))
    event = LogprobDelta("a", (token,))
    events = EventBuffer(max_events=16, max_chars=100 + 3 * LOGPROB_ENTRY_CHARS)
    assert events.put_nowait(event)
    assert events.held_chars == 1 + 3 * LOGPROB_ENTRY_CHARS
    assert events.put_nowait(Delta("b" * 99))
    assert not events.put_nowait(event)
    assert events.receive_nowait() == event
    assert events.held_chars == 99
    assert events.put_nowait(event)
    assert events.receive_nowait() == Delta("b" * 99)
    assert await events.receive() == event
    assert events.held_chars == 0


async def test_a_batch_stops_past_max_batch_chars() -> None:
    """One batch (one write to the client) takes delta text up to about MAX_BATCH_CHARS,
    leaving the rest for the next batch, so a stalled writer never holds more."""
    run, send = await _stream()
    await run.next_batch()
    piece = "x" * (MAX_BATCH_CHARS // 3)
    for _ in range(12):
        send.send_nowait(Delta(piece))
    first = await run.next_batch()
    assert isinstance(first, list)
    assert 1 < len(first) < 12
    assert sum(len(e.text) for e in first if isinstance(e, ContentOut)) <= 2 * MAX_BATCH_CHARS
    rest = []
    while len(first) + len(rest) < 12:
        batch = await run.next_batch()
        assert isinstance(batch, list)
        rest += batch
    assert all(e == ContentOut(piece) for e in [*first, *rest])


async def test_a_producer_waiting_for_room_gives_up_when_the_run_is_cancelled() -> None:
    """The node's read loop (asyncio) waits for room in a full buffer; cancelling the run
    through its handle wakes it at once with BrokenResourceError, so the read task ends
    and sends its CancelRun instead of waiting for the slow-consumer limit."""
    events = EventBuffer(max_events=16, max_chars=100)
    handle = RunHandle("r1", "node", events)
    assert events.put_nowait(Delta("a" * 100))
    outcome: list[BaseException] = []

    async def read_loop() -> None:  # as the gRPC read loop does, on the asyncio side
        await events.put(Delta("b" * 10))

    async def producer(task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        try:
            await call_asyncio(read_loop)
        except trio.BrokenResourceError as exc:
            outcome.append(exc)

    async with asyncio_loop():
        with trio.fail_after(10):  # generous: without the fix the put waits forever
            async with trio.open_nursery() as nursery:
                await nursery.start(producer)
                await trio.testing.wait_all_tasks_blocked()
                handle.cancel(EndCause.CLIENT_GONE)
    assert len(outcome) == 1
    assert events.held_chars == 100


async def test_a_session_the_edge_ended_cancels_the_run_on_the_node() -> None:
    """A session that fails on the edge's side (an answer past the held cap) before the
    node's terminal: leaving the run cancels the node's run, it does not wait for the
    node to finish an answer nobody will read."""
    node = PlayedNode()
    settings = SessionSettings(run_id="r1", whole_output=True, max_held_chars=4)
    run = (await RunKit(TIMEOUTS, node).run(stream=False, settings=settings)).reader
    handle = node.handle
    assert node.events.put_nowait(Delta("longer than the cap"))
    assert await run.next_batch() == [RoleOut()]
    batch = await run.next_batch()
    assert isinstance(batch, list)
    assert isinstance(batch[-1], ErrorOut)
    assert run.session.terminated
    run.close()
    assert handle.cause is EndCause.CLIENT_GONE


# --- the commit point: what is taken before the answer's status is chosen -----------------


def _answer(run: Run) -> Answer:
    """An answer whose run is `run`, as failover makes it for an attempt."""
    answer = Answer()
    answer.leg = run
    return answer


async def test_first_batch_stops_at_the_first_output(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The role chunk alone does not commit: the first batch runs to the first output, and
    the run then counts as having shown output (no failover past it)."""
    run, send = await _stream_run()
    send.send_nowait(Delta("hi"))
    taken, keepalive = await _answer(run).first_batch()
    assert (taken, keepalive) == ([RoleOut(), ContentOut("hi")], False)
    assert run.reader.output_seen


async def test_first_batch_an_error_before_output_is_no_output(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A node error before any output ends the first batch with the session's terminal and
    no output seen: the answer can still be a real status, or another node's."""
    run, send = await _stream_run()
    send.send_nowait(Failed("error", "boom"))
    taken, keepalive = await _answer(run).first_batch()
    assert (taken, keepalive) == ([RoleOut(), ErrorOut("run_error", "boom")], False)
    assert not run.reader.output_seen
    assert run.session.terminated


async def test_first_batch_a_keepalive_commits(autojump_clock: trio.testing.MockClock) -> None:
    """A keep-alive due before any output ends the first batch (the body starts with it):
    the answer's head went out, though no output did."""
    run, _send = await _stream_run(keepalive_s=3)
    start = trio.current_time()
    taken, keepalive = await _answer(run).first_batch()
    assert (taken, keepalive) == ([RoleOut()], True)
    assert trio.current_time() - start == 3
    assert not run.reader.output_seen
    assert run.reader.head_sent


async def test_a_long_delta_is_taken_a_slice_a_batch_with_a_pass_between() -> None:
    """One 3.8 MB delta: each batch carries at most one slice of it (SLICE_CHARS, plus
    what a filter held), the scheduler makes a pass between batches (a task that is
    always runnable runs once a pass: it runs between the slices, which a single step
    of the whole delta never let it), and the answer is the whole delta, then the
    terminal. (trio runs a pass's tasks in a random order, so the ticker's count is not
    exact: at least half the slices is what no single step could give.)"""
    run, send = await _stream()
    text = "<" * 3_800_000
    send.send_nowait(Delta(text))
    send.send_nowait(Complete())
    assert await run.next_batch() == [RoleOut()]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.lowlevel.checkpoint()
            ticks += 1

    batches: list[list[OutEvent]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        while not run.session.terminated:
            batch = await run.next_batch()
            assert isinstance(batch, list)
            batches.append(batch)
        nursery.cancel_scope.cancel()
    slices = -(-len(text) // SLICE_CHARS)
    assert len(batches) == slices + 1  # the slices, then the terminal
    sizes = [sum(len(e.text) for e in b if isinstance(e, ContentOut)) for b in batches]
    assert max(sizes) <= SLICE_CHARS + 16
    assert sum(sizes) == len(text)
    assert isinstance(batches[-1][-1], FinishOut)
    assert ticks >= slices // 2
