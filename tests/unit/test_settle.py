"""A run given up because its client left reads on a little before it is cancelled.

`edge.node.grpc.settle_read` lets the read loop go on for SETTLE_PASSES passes of
the asyncio loop, `RunHandle.settling` says which ends settle (a departed client)
and which cut at once, and an aborted `EventBuffer` drops what still comes,
noting a terminal. Pure: an asyncio task of the test's own stands in for a run's
read loop (asyncio runs ready callbacks in order, so passes count exactly); real
RunHandles and EventBuffers. The node's side, CancelRuns counted, is in
tests/integration/test_settle_e2e.py.
"""

from __future__ import annotations

import asyncio

import pytest
import trio

from edge.node.bridge import EventBuffer
from edge.node.client import EndCause, RunHandle
from edge.node.grpc import SETTLE_PASSES, settle_read
from edge.stream.events import Complete, Delta


def _settled(read_passes: int, passes: int) -> asyncio.Task[None]:
    """A read loop that ends after `read_passes` passes of the loop, settled for `passes`."""

    async def read() -> None:
        for _ in range(read_passes):
            await asyncio.sleep(0)

    async def main() -> asyncio.Task[None]:
        reading = asyncio.ensure_future(read())
        await asyncio.sleep(0)  # started, as a run's read loop is long before its end
        await settle_read(reading, passes)
        return reading

    return asyncio.run(main())


def test_a_read_that_ends_within_the_passes_is_taken_not_cancelled() -> None:
    """What the loop hands over within SETTLE_PASSES passes is taken: the read ends on
    its own (its terminal came), it is not cancelled."""
    reading = _settled(SETTLE_PASSES, SETTLE_PASSES)
    assert reading.done()
    assert not reading.cancelled()


def test_a_read_still_going_after_the_passes_is_cancelled() -> None:
    """A read not over after SETTLE_PASSES passes (the node still generating) is
    cancelled, and over when `settle_read` returns (its stream reset)."""
    reading = _settled(SETTLE_PASSES + 1, SETTLE_PASSES)
    assert reading.cancelled()


def test_no_passes_cancels_at_once() -> None:
    """An end that does not settle (a deadline, a slow client, shutdown) cancels at once."""
    reading = _settled(1, 0)
    assert reading.cancelled()


def _handle(deadline: float = float("inf")) -> RunHandle:
    return RunHandle("r", "n", EventBuffer(max_events=8, max_chars=64), deadline=deadline)


@pytest.mark.parametrize(
    ("cause", "settles"),
    [
        (EndCause.CLIENT_GONE, True),
        (EndCause.TIMEOUT, False),
        (EndCause.SLOW_CLIENT, False),
        (EndCause.SHUTDOWN, False),
    ],
)
def test_only_a_departed_client_settles(cause: EndCause, settles: bool) -> None:
    """A client that left lets the run take what its node already sent; the edge's own
    ends (deadline, slow client, shutdown) end the run at once."""

    async def main() -> None:
        handle = _handle()
        handle.cancel(cause)
        assert handle.settling() is settles

    trio.run(main)


def test_a_request_cut_from_outside_settles_unless_its_deadline_passed() -> None:
    """Cancelled from outside with no cause (the request's scope was cut), the run
    settles as a departed client's; past its deadline, it is a timeout: no settling."""

    async def main() -> None:
        assert _handle().settling()
        assert not _handle(deadline=trio.current_time() - 1).settling()

    trio.run(main)


def test_settling_drops_the_events_and_notes_the_terminal() -> None:
    """Settling, nobody reads the events: what still comes is dropped (the buffer never
    fills, so the read never waits for room), and a terminal is noted (no CancelRun)."""

    async def main() -> None:
        handle = _handle()
        handle.cancel(EndCause.CLIENT_GONE)
        assert handle.settling()
        events = handle.events
        for _ in range(100):  # more than the buffer holds
            assert events.put_nowait(Delta("x" * 32))
        assert events.held_chars == 0
        assert not events.terminal
        assert events.put_nowait(Complete())
        assert events.terminal

    trio.run(main)
