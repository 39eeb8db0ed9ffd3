"""The watch over HTTP/2 streams left unread, under trio's MockClock, and its frame reader.

`Stalls` counts a body send still waiting `stall_s` after it began as a stalled stream,
calls `calm_down` on its connection past the per-connection or total cap or after
`limit_s`, and gives the count back as sends end or connections go. `DataWritten`
reads the same DATA bytes whether the frames come whole or a byte at a time;
`Unwritten` holds a send past its limit until DATA bytes are written, or its
connection ends.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hyperframe.frame import DataFrame, HeadersFrame, PingFrame, SettingsFrame

from edge.http.stalls import DataWritten, StallCount, Stalls, Unwritten
from edge.observe.metrics import EdgeMetrics


class _Connection:
    def __init__(self) -> None:
        self.open = True
        self.why: list[str] = []

    def calm_down(self, why: str) -> None:
        self.why.append(why)

    async def handed(self, nbytes: int) -> None:  # pragma: no cover - not sent through here
        pass


def _stalls(per_connection: int = 2, total: int = 3) -> Stalls:
    return Stalls(
        stall_s=0.25, per_connection=per_connection, total=total, limit_s=30.0,
        gauge=EdgeMetrics().h2_stalled_streams,
    )  # fmt: skip


def _count(connection: _Connection) -> StallCount:
    return StallCount(connection)


async def test_sends_that_end_in_time_are_never_stalled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A send over before `stall_s` counts nothing; one still waiting then is stalled, and
    its end gives the count back."""
    stalls = _stalls()
    conn = _Connection()
    count = _count(conn)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stalls.run)
        quick = stalls.began(count)
        await trio.sleep(0.1)
        assert (stalls.stalled, count.stalled) == (0, 0)
        stalls.ended(quick)
        slow = stalls.began(count)
        await trio.sleep(1.0)
        assert (stalls.stalled, count.stalled) == (1, 1)
        stalls.ended(slow)
        stalls.ended(slow)  # twice: once
        assert (stalls.stalled, count.stalled) == (0, 0)
        assert conn.why == []
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("connections", "expected"), [(1, "on this connection"), (3, "more than 3 HTTP/2 streams wait")]
)
async def test_past_a_cap_the_connection_is_calmed_down(
    autojump_clock: trio.testing.MockClock, connections: int, expected: str
) -> None:
    """More stalled streams than `per_connection` on one connection, or than `total` over
    several, and the connection with the newest is told to calm down."""
    stalls = _stalls(per_connection=2, total=3)
    conns = [_Connection() for _ in range(connections)]
    counts = [_count(c) for c in conns]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stalls.run)
        for i in range(4):
            stalls.began(counts[i % connections])
            await trio.sleep(0.01)
        await trio.sleep(1.0)
        told = [c for c in conns if c.why]
        assert len(told) == 1
        assert expected in told[0].why[0]
        for conn, count in zip(conns, counts, strict=True):
            conn.open = False
            stalls.forget(count)
        assert stalls.stalled == 0
        nursery.cancel_scope.cancel()


async def test_a_stream_stalled_for_the_limit_closes_its_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One stalled stream, under every cap, is told to calm down at `limit_s`."""
    stalls = _stalls()
    conn = _Connection()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stalls.run)
        stalls.began(_count(conn))
        await trio.sleep(10.0)
        assert conn.why == []
        await trio.sleep(25.0)
        assert conn.why == ["an HTTP/2 stream waited 30s for its flow-control window"]
        nursery.cancel_scope.cancel()


def test_data_bytes_are_read_the_same_whole_or_byte_by_byte() -> None:
    """DATA payload bytes are counted from frame headers alone, wherever the writes split."""
    frames = b"".join(
        f.serialize()
        for f in (
            SettingsFrame(0),
            HeadersFrame(1, b"\x88", flags=["END_HEADERS"]),
            DataFrame(1, b"x" * 1000),
            PingFrame(0, opaque_data=b"12345678"),
            DataFrame(3, b"y" * 17, flags=["END_STREAM"]),
        )
    )
    assert DataWritten().feed(frames) == 1017
    reader = DataWritten()
    assert sum(reader.feed(frames[i : i + 1]) for i in range(len(frames))) == 1017


async def test_a_send_past_the_unwritten_limit_waits_for_data_written() -> None:
    """Bytes handed within the limit return at once; past it the send waits until the
    DATA frames written bring the bytes held under the limit again, or the end."""
    unwritten = Unwritten(limit=1000)
    await unwritten.handed(1000)  # at the limit: no wait
    returned: list[int] = []

    async def hand(nbytes: int) -> None:
        await unwritten.handed(nbytes)
        returned.append(nbytes)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hand, 500)
        await trio.testing.wait_all_tasks_blocked()
        unwritten.wrote(DataFrame(1, b"x" * 400).serialize())  # 1100 held: still over
        await trio.testing.wait_all_tasks_blocked()
        assert returned == []
        unwritten.wrote(DataFrame(1, b"x" * 100).serialize())  # 1000 held
    assert returned == [500]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hand, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert returned == [500]
        unwritten.end()  # the connection is over: nothing waits any more
    assert returned == [500, 1]


class _Handing(_Connection):
    """A connection whose `handed` waits until the test lets it go on."""

    def __init__(self) -> None:
        super().__init__()
        self.go = trio.Event()

    async def handed(self, nbytes: int) -> None:
        await self.go.wait()


async def test_a_stream_that_closes_while_its_send_waits_ends_once() -> None:
    """The client's disconnect arrives while a body send still waits (the stream closed
    under it): the disconnect ends the send's record, and the send's own end, later,
    neither fails nor counts it again."""
    stalls = _stalls()
    conn = _Handing()
    disconnected = trio.Event()

    async def app(scope: object, receive: object, send: object, *_: object) -> None:
        async def body() -> None:
            await send({"type": "http.response.body", "body": b"x"})  # type: ignore[operator]

        async with trio.open_nursery() as inner:
            inner.start_soon(body)
            await trio.testing.wait_all_tasks_blocked()
            assert await receive() == {"type": "http.disconnect"}  # type: ignore[operator]
            disconnected.set()

    async def receive() -> dict[str, str]:
        return {"type": "http.disconnect"}

    async def send(message: object) -> None:
        pass

    watched, count = stalls.watch(app, conn)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            watched, {"type": "http", "http_version": "2"}, receive, send, None, None
        )
        await disconnected.wait()
        conn.go.set()
    assert (stalls.stalled, count.stalled) == (0, 0)
