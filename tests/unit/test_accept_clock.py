"""The accept clock of a run's start: `accept_s` to write the RunRequest, then `accept_s`
from the write for the node to accept it (`GrpcNodeClient.start_run`). The write is a
mark on the run's event buffer, not an item: the starter is woken by ACCEPTED alone."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from edge.errors import NodeTimeoutError
from edge.node.bridge import EventBuffer
from edge.node.client import RunHandle
from edge.node.grpc import Accepted
from edge.node.wire import PreparedRunRequest
from tests.unit.runkit import PlayedClient

ACCEPT_S = 1.0


class SlowNode(PlayedClient):
    """A node that takes `write_s` to have the RunRequest written (None: never) and then
    `accept_s` to accept it (None: never)."""

    def __init__(self, write_s: float | None, accept_s: float | None) -> None:
        super().__init__("slow")
        self.write_s = write_s
        self.accept_s = accept_s

    async def play(self, events: EventBuffer) -> None:
        if self.write_s is None:
            await trio.sleep_forever()
        await trio.sleep(self.write_s)
        events.mark_sent()
        if self.accept_s is None:
            await trio.sleep_forever()
        await trio.sleep(self.accept_s)
        assert events.put_nowait(Accepted("i"))
        await trio.sleep_forever()


async def _start(node: SlowNode) -> RunHandle | NodeTimeoutError:
    """The run started on `node` (then ended), or the error its start raised."""
    request = PreparedRunRequest(b"", "run-1").attempt(0)
    async with trio.open_nursery() as nursery:
        try:
            handle = await node.start_run(
                nursery, request, deadline=trio.current_time() + 60, accept_s=ACCEPT_S
            )
        except NodeTimeoutError as exc:
            return exc
        nursery.cancel_scope.cancel()
    return handle


@pytest.mark.parametrize(
    ("write_s", "accept_s"),
    [(0.0, 0.9), (0.9, 0.9), (0.5, 0.99)],
)
async def test_a_run_written_late_has_accept_s_from_its_write(
    autojump_clock: trio.testing.MockClock, write_s: float, accept_s: float
) -> None:
    """Written at any time within `accept_s`, a run accepted within `accept_s` of its
    write starts, though the two add up past `accept_s`."""
    node = SlowNode(write_s, accept_s)
    handle = await _start(node)
    assert isinstance(handle, RunHandle)
    assert handle.instance == "i"
    assert list(node.cancels.values()) == [1]  # ended by the test: cancelled on the node once


@pytest.mark.parametrize(
    ("write_s", "accept_s", "sent", "says"),
    [
        (None, None, False, "could not be sent"),
        (0.5, None, True, "did not accept the run in 1.0s"),
        (0.2, 1.1, True, "did not accept the run in 1.0s"),
    ],
)
async def test_a_run_not_written_or_not_accepted_in_time_fails_saying_which(
    autojump_clock: trio.testing.MockClock,
    write_s: float | None,
    accept_s: float | None,
    sent: bool,
    says: str,
) -> None:
    """Not written within `accept_s`: "could not be sent", `sent` False (another attempt
    may go to the node). Written, then not accepted within `accept_s` of the write:
    "did not accept", `sent` True. Either way the wait is bounded and the run is over
    when the start raises, cancelled on the node once."""
    node = SlowNode(write_s, accept_s)
    start = trio.current_time()
    raised = await _start(node)
    assert isinstance(raised, NodeTimeoutError)
    assert says in raised.message
    assert raised.sent is sent
    waited = trio.current_time() - start
    assert waited == pytest.approx((write_s or 0.0) + ACCEPT_S, abs=0.01)
    assert list(node.cancels.values()) == [1]
