"""The one place where trio and asyncio meet.

grpclib is asyncio-only. The edge runs on trio; grpclib (with redis-py's asyncio
client and the embedded simulated node) runs on an asyncio loop of its own, in
one thread of the process, opened by `asyncio_loop`. This module runs that
loop, awaits asyncio coroutines from trio (`call_asyncio`: a trio cancel
cancels the asyncio task and waits for it to be over), and carries a run's
events from its asyncio read loop to the trio side (`read_into`): the read
loop puts them into an `Inbox`, the run's read task moves them into the
run's `EventBuffer`, bounded in count and in bytes, and in sum over the
process (`edge.node.backlog`).

Why a thread and not a loop hosted inside trio (trio-asyncio, which the edge
used before): a hosted loop runs one asyncio callback per pass of trio's
scheduler, and a pass also steps every ready trio task. Under load (hundreds
of streams, each with its HTTP tasks) the gRPC side fell up to a second behind
the HTTP side, and runs missed their accept deadline on nodes that were fine
(BENCHMARKS.md "The asyncio loop in a thread"). A loop of its own runs every
ready callback in each pass, and the two share the interpreter by its lock.
The loop is uvloop's (libuv, its transports in C): the less the loop's own
machinery holds that lock, the sooner trio's thread gets it back.

Nothing else in the edge starts an asyncio loop for grpclib; nothing outside
`edge.node` (and the nodes it embeds) imports asyncio.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, ParamSpec, TypeVar, cast

import trio
import uvloop

from edge.node.backlog import Backlog
from edge.node.grpc import Accepted, EventSink
from edge.stream.events import Complete, Delta, Failed, LogprobDelta, NodeEvent, ReasoningDelta

P = ParamSpec("P")
T = TypeVar("T")

Item = NodeEvent | Accepted

_TEXT_EVENTS = frozenset({Delta, ReasoningDelta})
_TERMINAL_EVENTS = frozenset({Complete, Failed})
# What an Inbox holds before its read loop waits (the run's read task moves it on
# at once, unless the run's EventBuffer is full): events, and characters of text.
INBOX_EVENTS = 64
INBOX_CHARS = 64 * 1024


def _size(item: Item) -> int:
    """What an event other than a plain text delta counts against `max_chars`: a delta
    with logprobs counts its text and its entries; anything else nothing."""
    return item.size if type(item) is LogprobDelta else 0


def _chars(item: Item) -> int:
    return len(item.text) if type(item) in _TEXT_EVENTS else _size(item)  # type: ignore[union-attr]


# The loop of the innermost `asyncio_loop` block (trio tasks inherit it from the task
# that starts them); a process may run several (tests run two edges in one).
_LOOP: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "edge_asyncio_loop", default=None
)


def _running_loop() -> asyncio.AbstractEventLoop:
    loop = _LOOP.get()
    if loop is None:
        raise RuntimeError("no asyncio loop: call this inside `async with asyncio_loop()`")
    return loop


@asynccontextmanager
async def asyncio_loop() -> AsyncIterator[None]:
    """Run the asyncio loop for grpclib in a thread for the duration of the block.

    On the way out, the tasks still on the loop are cancelled and waited for,
    then the loop stops and its thread is joined.
    """
    loop = uvloop.new_event_loop()
    token = trio.lowlevel.current_trio_token()
    stopped = trio.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            token.run_sync_soon(stopped.set)

    thread = threading.Thread(target=serve, name="edge-asyncio", daemon=True)
    thread.start()
    opened = _LOOP.set(loop)
    try:
        yield
    finally:
        with trio.CancelScope(shield=True):
            try:
                await call_asyncio(_cancel_the_rest)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                await stopped.wait()
                thread.join()
                loop.close()
                _LOOP.reset(opened)


async def _cancel_the_rest() -> None:
    """Cancel the loop's other tasks and wait for them; close its async generators."""
    me = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


class _Call:
    """One asyncio task started from trio: `done` is set (on the trio side) once it is over."""

    __slots__ = ("_token", "done", "error", "task", "then")

    def __init__(self, token: trio.lowlevel.TrioToken, then: Callable[[], object] | None) -> None:
        self._token = token
        self.done = trio.Event()
        self.then = then
        self.task: asyncio.Task[Any] | None = None
        self.error: BaseException | None = None

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: contextvars.Context,
    ) -> None:
        """On the asyncio loop: start `fn(*args, **kwargs)` as a task."""
        try:
            awaitable = context.run(fn, *args, **kwargs)
            coro = awaitable if asyncio.iscoroutine(awaitable) else _awaited(awaitable)
            self.task = loop.create_task(coro, context=context)
        except BaseException as exc:  # fn failed before it returned an awaitable
            self.error = exc
            self._token.run_sync_soon(self._over)
            return
        self.task.add_done_callback(self._finished)

    def _finished(self, _task: asyncio.Task[Any]) -> None:
        self._token.run_sync_soon(self._over)

    def _over(self) -> None:  # on the trio side
        self.done.set()
        if self.then is not None:
            self.then()

    def cancel(self) -> None:
        """On the asyncio loop (after `start`, which always runs first)."""
        if self.task is not None:
            self.task.cancel()

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        assert self.task is not None
        if self.task.cancelled():
            raise RuntimeError("the asyncio loop closed before the call ended")
        return self.task.result()


def _start(
    fn: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    then: Callable[[], object] | None = None,
) -> tuple[asyncio.AbstractEventLoop, _Call]:
    loop = _running_loop()
    call = _Call(trio.lowlevel.current_trio_token(), then)
    loop.call_soon_threadsafe(call.start, loop, fn, args, kwargs, contextvars.copy_context())
    return loop, call


async def call_asyncio(fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Await the asyncio coroutine `fn(*args)` from trio; trio cancellation cancels it
    (and returns once the asyncio task is over)."""
    loop, call = _start(fn, args, kwargs)
    try:
        await call.done.wait()
    except BaseException:
        loop.call_soon_threadsafe(call.cancel)
        with trio.CancelScope(shield=True):
            await call.done.wait()
        raise
    return cast("T", call.result())


def _resolve(room: asyncio.Future[None]) -> None:
    if not room.done():
        room.set_result(None)


class Inbox:
    """A run's events between its asyncio read loop and its trio read task.

    The read loop (the `EventSink` side, on the asyncio thread) appends; the
    read task (`read_into`, on trio's) takes them into the run's `EventBuffer`.
    Each side writes only its own counters, and the deque's append and popleft
    are atomic, so neither side takes a lock. The first event of a batch wakes
    the read task (one hand-over through trio's token for the batch). Past
    INBOX_EVENTS events or INBOX_CHARS characters waiting, `put_nowait` says
    False and the read loop waits in `put` (the EventBuffer is full: the client
    reads slowly), and HTTP/2 flow control slows the node down.
    """

    __slots__ = (
        "_done", "_in", "_in_chars", "_items", "_loop", "_lot", "_out", "_out_chars",
        "_room", "_token", "_wake_pending", "settle",
    )  # fmt: skip

    def __init__(self, loop: asyncio.AbstractEventLoop, token: trio.lowlevel.TrioToken) -> None:
        self._loop = loop
        self._token = token
        self._items: deque[Item] = deque()
        self._in = self._in_chars = 0  # written by the read loop only
        self._out = self._out_chars = 0  # written by the read task only
        self._wake_pending = False
        self._lot = trio.lowlevel.ParkingLot()
        self._room: asyncio.Future[None] | None = None
        self._done = False
        # Decided on the trio side before the read loop is cancelled: it settles.
        self.settle = False

    # --- the read loop's side (asyncio) -------------------------------------------

    def _full(self) -> bool:
        return (
            self._in - self._out >= INBOX_EVENTS or self._in_chars - self._out_chars > INBOX_CHARS
        )

    def _push(self, item: Item) -> None:
        self._items.append(item)
        self._in += 1
        self._in_chars += _chars(item)
        if not self._wake_pending:
            self._wake_pending = True
            self._token.run_sync_soon(self._wake)

    def put_nowait(self, item: Item) -> bool:
        if self._full():
            return False
        self._push(item)
        return True

    async def put(self, item: Item) -> None:
        """Queue `item`, then wait until the read task took enough."""
        self._push(item)
        while self._full():
            room = self._loop.create_future()
            self._room = room
            if not self._full():  # taken between the check and the publication
                self._room = None
                return
            await room

    def settles(self) -> bool:
        return self.settle

    # --- the read task's side (trio) ----------------------------------------------

    def _wake(self) -> None:
        self._wake_pending = False
        self._lot.unpark_all()

    def _finish(self) -> None:
        self._done = True
        self._lot.unpark_all()

    def _give_room(self) -> None:
        room = self._room
        if room is not None and not self._full():
            self._room = None
            self._loop.call_soon_threadsafe(_resolve, room)

    async def move(self, events: EventBuffer, *, waiting: bool) -> None:
        """Move what comes into `events` until the read loop is over and all of it was
        taken. `waiting`: wait for room in `events` (its bounds); else an event that
        finds no room is dropped (the run was given up), a terminal noted."""
        items = self._items
        while True:
            while items:
                item = items.popleft()
                self._out += 1
                self._out_chars += _chars(item)
                if not events.put_nowait(item):
                    if waiting:
                        await events.put(item)
                    else:
                        events.note(item)
            self._give_room()
            if self._done and not items:
                return
            await self._lot.park()


async def read_into(
    events: EventBuffer,
    settles: Callable[[], bool],
    fn: Callable[[EventSink], Awaitable[None]],
) -> None:
    """Run `fn(inbox)` on the asyncio loop (a run's read loop), moving the events it
    puts into `events` as they come, with the buffer's bounds.

    Ends when `fn` does, raising its error. Cancelled (or failed while waiting
    for room: trio.TooSlowError, trio.BrokenResourceError), the read loop is
    cancelled, told first whether it settles (`settles()`, asked here, on the
    trio side); what it still puts is moved without waiting until it is over.
    """
    loop = _running_loop()
    inbox = Inbox(loop, trio.lowlevel.current_trio_token())
    loop, call = _start(fn, (inbox,), {}, then=inbox._finish)
    try:
        await inbox.move(events, waiting=True)
    except BaseException as exc:
        inbox.settle = isinstance(exc, trio.Cancelled) and settles()
        loop.call_soon_threadsafe(call.cancel)
        with trio.CancelScope(shield=True):
            await inbox.move(events, waiting=False)
        raise
    call.result()


class EventBuffer:
    """One run's events between its read task and its writer (both trio).

    Bounded twice: in events (`max_events`) and in delta text held
    (`max_chars` characters: that many bytes for ASCII text, at most four
    times that for any text, as CPython stores a string at 1, 2 or 4 bytes a
    character; `len` is what the fast path can afford, `sys.getsizeof` would
    about double the cost of a put and its receive). A stream whose client stops reading holds at
    most that much here, whatever the size of its deltas; the read loop waits
    and HTTP/2 flow control slows the node down. One delta larger than the
    bound still passes, alone (the gRPC message cap bounds it).

    And bounded in sum: the text held counts into the process's `backlog`
    (`edge.node.backlog`), and a producer waiting for room is one of the
    backlog's waiters. Past the backlog's budget the oldest waiters are `cut`:
    their wait ends as at `limit_s`. A buffer leaves the backlog once
    (`release`, at the end of its run's read task, or when cut); what it holds
    then no longer counts.

    The producer side is the run's read task, which moves the events its
    read loop puts into an `Inbox` (`read_into`: `put_nowait`, `put`); the
    consumer side is `receive`/`receive_nowait`, as on a trio memory channel
    (trio.WouldBlock, trio.EndOfChannel).
    """

    __slots__ = (
        "_aborted",
        "_backlog",
        "_chars",
        "_limit_s",
        "_max_chars",
        "_put",
        "_put_scope",
        "_receive",
        "_receive_nowait",
        "_released",
        "_room",
        "_send",
        "_send_nowait",
        "_waiting",
        "cut_by_backlog",
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
        self._chars = 0
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
        # The backlog's budget ended the producer's wait (see cut).
        self.cut_by_backlog = False
        # The read loop handed over the node's terminal event: the node ended the
        # run, whether or not the writer has taken the event yet.
        self.terminal = False

    @property
    def held_chars(self) -> int:
        """Characters of delta text waiting for the writer."""
        return self._chars

    # --- producer (the run's read task) ----------------------------------------

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
        held = self._chars
        if held and held + size > self._max_chars:
            return False
        try:
            self._send_nowait(item)
        except trio.WouldBlock:
            return False
        self._chars = held + size
        backlog = self._backlog
        backlog.chars += size
        if backlog.chars > backlog.budget:
            backlog.over()
        if not size and type(item) in _TERMINAL_EVENTS:
            self.terminal = True
        return True

    async def put(self, item: Item) -> None:
        """Wait for room (the read loop waits behind this, and HTTP/2 flow control
        slows the node down).

        Waiting longer than `limit_s` raises trio.TooSlowError: the consumer
        is stuck (a client that stopped reading). So does a wait the backlog
        cut (`cut`).
        """
        if type(item) in _TERMINAL_EVENTS:
            self.terminal = True
        await self._wait_put(item)

    def note(self, item: Item) -> None:
        """An event that found no room after the run was given up: dropped, a terminal
        noted (the node ended the run)."""
        if type(item) in _TERMINAL_EVENTS:
            self.terminal = True

    async def _wait_put(self, item: Item) -> None:
        size = len(item.text) if type(item) in _TEXT_EVENTS else _size(item)  # type: ignore[union-attr]
        backlog = self._backlog
        with trio.move_on_after(self._limit_s) as scope:
            self._put_scope = scope
            if self._aborted or self.cut_by_backlog:
                scope.cancel()
            # A waiter of the backlog from here on: the budget may cut it, now or later.
            backlog.wait(self)
            try:
                while self._chars and self._chars + size > self._max_chars:
                    self._waiting = True
                    await self._room.park()
                await self._send.send(item)
            finally:
                backlog.done_waiting(self)
        self._put_scope = None
        if not scope.cancelled_caught:  # the item is in
            self._chars += size
            backlog = self._backlog
            backlog.chars += size
            if backlog.chars > backlog.budget:
                backlog.over()
        if self._aborted and scope.cancelled_caught:
            raise trio.BrokenResourceError("the run's consumer is gone")
        if scope.cancelled_caught or self.cut_by_backlog:
            raise trio.TooSlowError

    def cut(self) -> None:
        """The backlog's budget passed while this producer waited longest: its wait
        ends as at `limit_s` (trio.TooSlowError), and the buffer leaves the backlog."""
        self.cut_by_backlog = True
        self.release()
        if self._put_scope is not None:
            self._put_scope.cancel()

    def release(self) -> None:
        """Leave the backlog (once): the text held leaves its total, and what the
        buffer takes or gives from now on counts on a tally of its own."""
        if self._released:
            return
        self._released = True
        self._backlog.chars -= self._chars
        own = Backlog()
        own.chars = self._chars
        self._backlog = own

    def abort(self) -> None:
        """The run was ended from the edge's side: a producer waiting for room gives up.

        Its read task may be cancelled after the read loop it moves events for
        (settling); a wait for room the run no longer needs ends here.
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
            self._chars -= size
            self._backlog.chars -= size
            if self._waiting:
                self._waiting = False
                self._room.unpark_all()
        return cast("NodeEvent", item)

    def receive_nowait(self) -> NodeEvent:
        item = self._receive_nowait()
        if type(item) in _TEXT_EVENTS:  # _taken, inlined: the per-event path
            size = len(item.text)  # type: ignore[union-attr]
            self._chars -= size
            self._backlog.chars -= size
            if self._waiting:
                self._waiting = False
                self._room.unpark_all()
        elif type(item) is LogprobDelta:
            return self._taken(item)
        return item  # type: ignore[return-value]

    async def receive(self) -> NodeEvent:
        return self._taken(await self._receive.receive())
