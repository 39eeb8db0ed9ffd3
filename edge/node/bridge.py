"""The one place where trio and asyncio meet.

grpclib is asyncio-only. The edge runs on trio, with an asyncio loop hosted
inside it by trio-asyncio. This module opens that loop, runs asyncio
coroutines from trio, and holds each run's events between the asyncio read
loop (an `EventSink`) and the trio writer, bounded in count and in bytes, and
in sum over the process (`edge.node.backlog`).
Nothing else in the edge uses trio_asyncio (the package imports it first, before
grpclib: see `edge.node`); nothing outside `edge.node` (and the simulated node)
imports asyncio.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, ParamSpec, TypeVar, cast

import trio
import trio_asyncio

from edge.node.backlog import Backlog
from edge.node.grpc import Accepted
from edge.stream.events import Complete, Delta, Failed, LogprobDelta, NodeEvent, ReasoningDelta

P = ParamSpec("P")
T = TypeVar("T")

Item = NodeEvent | Accepted

_TEXT_EVENTS = frozenset({Delta, ReasoningDelta})
_TERMINAL_EVENTS = frozenset({Complete, Failed})


def _size(item: Item) -> int:
    """What an event other than a plain text delta counts against `max_chars`: a delta
    with logprobs counts its text and its entries; anything else nothing."""
    return item.size if type(item) is LogprobDelta else 0


def grpclib_came_first() -> bool:
    """Whether grpclib's module that keeps asyncio.current_task (`grpclib.utils`) began
    loading before trio_asyncio did (sys.modules holds modules in that order)."""
    names = list(sys.modules)
    return "grpclib.utils" in names and names.index("grpclib.utils") < names.index("trio_asyncio")


@asynccontextmanager
async def asyncio_loop() -> AsyncIterator[None]:
    """Host an asyncio loop inside the current trio run for grpclib.

    Raises RuntimeError in a process where grpclib was imported before trio_asyncio
    (`edge.node` says why), on every Python: from 3.12 each grpclib call would fail
    with "no running event loop"."""
    if grpclib_came_first():
        raise RuntimeError(
            "grpclib was imported before trio_asyncio, so it cannot find the asyncio loop"
            " trio-asyncio hosts (python-trio/trio-asyncio#83): import edge.node first"
        )
    async with trio_asyncio.open_loop():
        yield


async def call_asyncio(fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Await the asyncio coroutine `fn(*args)` from trio; trio cancellation cancels it."""
    result: T = await trio_asyncio.aio_as_trio(fn)(*args, **kwargs)
    return result


async def call_asyncio_settled(
    coro: Coroutine[Any, Any, T], settle: Callable[[asyncio.Task[T]], Awaitable[None]]
) -> T:
    """Run the asyncio coroutine `coro` as a task of the hosted loop and await it from
    trio. Trio cancellation does not reach the task itself: the caller, cancelled,
    awaits `settle(task)` on the loop (shielded), which ends it its own way, then the
    cancellation goes on.

    One asyncio task and a done callback: a caller that must not be cut between two
    awaits of the task (a message's header and its body) needs no second task and
    no `asyncio.shield` around it.
    """
    task: asyncio.Task[T] = trio_asyncio.current_loop.get().create_task(coro)
    done = trio.Event()
    task.add_done_callback(lambda _: done.set())
    try:
        await done.wait()
    except trio.Cancelled:
        with trio.CancelScope(shield=True):
            await trio_asyncio.aio_as_trio(settle)(task)
        raise
    result: T = task.result()
    return result


class EventBuffer:
    """One run's events between the node's read loop (asyncio) and its writer (trio).

    Bounded twice: in events (`max_events`) and in delta text held
    (`max_chars` characters: that many bytes for ASCII text, at most four
    times that for any text, as CPython stores a string at 1, 2 or 4 bytes a
    character; `len` is what the fast path can afford, `sys.getsizeof` would
    about double the cost of a put and its receive). A stream whose client stops reading holds at
    most that much here, whatever the size of its deltas; the read loop waits
    and HTTP/2 flow control slows the node down. One delta larger than the
    bound still passes, alone (the gRPC message cap bounds it).

    A producer that must wait for room says its client stopped reading: whoever
    keeps a copy of the answer for later (a migration's tap) is told
    (`on_stall`), once as the wait begins and once more if the backlog cuts it.

    And bounded in sum: the text held counts into the process's `backlog`
    (`edge.node.backlog`), and a producer waiting for room is one of the
    backlog's waiters. Past the backlog's budget the oldest waiters are `cut`:
    their wait ends as at `limit_s`. A buffer leaves the backlog once
    (`release`, at the end of its run's read task, or when cut); what it holds
    then no longer counts.

    The producer side is the `EventSink` of `edge.node.grpc` (`put_nowait`,
    `put`); the consumer side is `receive`/`receive_nowait`, as on a trio
    memory channel (trio.WouldBlock, trio.EndOfChannel).
    """

    __slots__ = (
        "_aborted",
        "_backlog",
        "_limit_s",
        "_max_chars",
        "_on_stall",
        "_put",
        "_put_scope",
        "_receive",
        "_receive_nowait",
        "_released",
        "_room",
        "_send",
        "_send_nowait",
        "_stalled",
        "_waiting",
        "cut_by_backlog",
        "held_chars",
        "sent_at",
        "terminal",
    )

    def __init__(
        self,
        *,
        max_events: int,
        max_chars: int,
        limit_s: float = math.inf,
        backlog: Backlog | None = None,
    ) -> None:
        send, receive = trio.open_memory_channel[Item](max_events)
        self._send = send
        self._send_nowait = send.send_nowait
        self._receive = receive
        self._receive_nowait = receive.receive_nowait
        self._max_chars = max_chars
        # Characters of delta text waiting for the writer (read by it; kept here).
        self.held_chars = 0
        self._limit_s = limit_s
        # Where the text held is counted: the process's backlog until `release`,
        # then a tally of this buffer's own (nobody's total).
        self._backlog = Backlog() if backlog is None else backlog
        self._released = False
        # The producer parks here while the text bound is reached.
        self._room = trio.lowlevel.ParkingLot()
        self._waiting = False
        # The consumer is gone: a producer waiting for room gives up (see abort).
        self._aborted = False
        self._put_scope: trio.CancelScope | None = None
        # Told when the producer first waits for room, and when it is cut (on_stall).
        self._on_stall: Callable[[bool], object] | None = None
        self._stalled = False
        # The backlog's budget ended the producer's wait (see cut).
        self.cut_by_backlog = False
        # The read loop handed over the node's terminal event: the node ended the
        # run, whether or not the writer has taken the event yet.
        self.terminal = False
        # When the run's RunRequest was written to the node (trio's clock; None: not
        # yet): `mark_sent`.
        self.sent_at: float | None = None

    # --- producer (the node's read loop) ----------------------------------------

    def mark_sent(self) -> None:
        """The run's RunRequest is written to the node: noted, nobody woken."""
        self.sent_at = trio.current_time()

    def put_nowait(self, item: Item) -> bool:
        """Queue `item` if both bounds leave room; False when the caller must `put`.

        Once the consumer is gone (`abort`), items are dropped (a terminal noted):
        a run whose client left reads on only to see whether its terminal comes.
        """
        if self._aborted:
            if type(item) in _TERMINAL_EVENTS:
                self.terminal = True
            return True
        size = len(item.text) if type(item) in _TEXT_EVENTS else _size(item)  # type: ignore[union-attr]
        held = self.held_chars
        if held and held + size > self._max_chars:
            return False
        try:
            self._send_nowait(item)
        except trio.WouldBlock:
            return False
        self.held_chars = held + size
        backlog = self._backlog
        backlog.chars += size
        if backlog.chars > backlog.budget:
            backlog.over()
        if not size and type(item) in _TERMINAL_EVENTS:
            self.terminal = True
        return True

    def put(self, item: Item) -> Awaitable[None]:
        """Wait for room (backpressure reaches the node through HTTP/2 flow control).

        Waiting longer than `limit_s` raises trio.TooSlowError: the consumer
        is stuck (a client that stopped reading). So does a wait the backlog
        cut (`cut`).
        """
        if type(item) in _TERMINAL_EVENTS:
            self.terminal = True
        # Wrapped per call (the slow path): a wrapper kept on the buffer would hold
        # its bound method, a cycle only the garbage collector frees.
        put: Awaitable[None] = trio_asyncio.trio_as_aio(self.wait_put)(item)
        return put

    async def wait_put(self, item: Item) -> None:
        """`put` for a producer on trio (the wait itself: `put` is its asyncio face)."""
        size = len(item.text) if type(item) in _TEXT_EVENTS else _size(item)  # type: ignore[union-attr]
        backlog = self._backlog
        with trio.move_on_after(self._limit_s) as scope:
            self._put_scope = scope
            if self._aborted or self.cut_by_backlog:
                scope.cancel()
            # A waiter of the backlog from here on: the budget may cut it, now or later.
            backlog.wait(self)
            try:
                if not self._stalled and (told := self._on_stall) is not None:
                    told(False)
                self._stalled = True
                while self.held_chars and self.held_chars + size > self._max_chars:
                    self._waiting = True
                    await self._room.park()
                await self._send.send(item)
            finally:
                backlog.done_waiting(self)
        self._put_scope = None
        if not scope.cancelled_caught:  # the item is in
            self.held_chars += size
            backlog = self._backlog
            backlog.chars += size
            if backlog.chars > backlog.budget:
                backlog.over()
        if self._aborted and scope.cancelled_caught:
            raise trio.BrokenResourceError("the run's consumer is gone")
        if scope.cancelled_caught or self.cut_by_backlog:
            raise trio.TooSlowError

    def on_stall(self, callback: Callable[[bool], object]) -> None:
        """Call `callback(False)` when the producer first waits for room (at once if it
        has already), and `callback(True)` if the backlog cuts it; forgotten when the
        buffer leaves the backlog (`release`)."""
        if self._released:
            return
        self._on_stall = callback
        if self._stalled:
            callback(False)

    def cut(self) -> None:
        """The backlog's budget passed while this producer waited longest: its wait
        ends as at `limit_s` (trio.TooSlowError), and the buffer leaves the backlog."""
        self.cut_by_backlog = True
        if (told := self._on_stall) is not None:
            told(True)
        self.release()
        if self._put_scope is not None:
            self._put_scope.cancel()

    def release(self) -> None:
        """Leave the backlog (once): the text held leaves its total, and what the
        buffer takes or gives from now on counts on a tally of its own."""
        if self._released:
            return
        self._released = True
        self._on_stall = None  # (a tap's owner: its run may be retired and let go)
        self._backlog.chars -= self.held_chars
        own = Backlog()
        own.chars = self.held_chars
        self._backlog = own

    def abort(self) -> None:
        """The run was ended from the edge's side: a producer waiting for room gives up.

        The wait runs as a trio task of the asyncio bridge, outside the read
        task's cancel scope, so cancelling the read task alone may leave it
        parked (until `limit_s`) while the read task waits for it.
        """
        self._aborted = True
        if self._put_scope is not None:
            self._put_scope.cancel()

    def close(self) -> None:
        """No more events: the consumer sees trio.EndOfChannel once it took the rest."""
        self._send.close()

    def clear(self) -> None:
        """Drop the events nobody will read (the run was ended from the edge's side).

        At most `max_events` steps of constant work; the writer, if it ever reads
        again, finds the end of the events (or what the producer still adds).
        """
        while True:
            try:
                self.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return

    # --- consumer (the stream's writer) -----------------------------------------

    # The first item is always ACCEPTED, taken by whoever starts the run; the
    # consumer sees node events after it (typed so, to spare a check per event).

    def _taken(self, item: Item) -> NodeEvent:
        kind = type(item)
        if kind in _TEXT_EVENTS or kind is LogprobDelta:
            size = len(item.text) if kind in _TEXT_EVENTS else _size(item)  # type: ignore[union-attr]
            self.held_chars -= size
            self._backlog.chars -= size
            if self._waiting:
                self._waiting = False
                self._room.unpark_all()
        return cast("NodeEvent", item)

    def receive_nowait(self) -> NodeEvent:
        item = self._receive_nowait()
        if type(item) in _TEXT_EVENTS:  # _taken, inlined: the per-event path
            size = len(item.text)  # type: ignore[union-attr]
            self.held_chars -= size
            self._backlog.chars -= size
            if self._waiting:
                self._waiting = False
                self._room.unpark_all()
        elif type(item) is LogprobDelta:
            return self._taken(item)
        return item  # type: ignore[return-value]

    async def receive(self) -> NodeEvent:
        return self._taken(await self._receive.receive())

    async def receive_start(self) -> Item:
        """The next item while the run starts (ACCEPTED), for its starter."""
        return await self._receive.receive()
