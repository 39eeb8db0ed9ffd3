"""Heavy steps take turns, so that light requests never wait behind a burst of them.

trio runs every runnable task once per pass of its scheduler, in no order of
importance: when 200 requests arrive at once, each pass runs a step of each of
them, a pass takes tens of milliseconds, and a `/healthz` probe, which needs a
handful of passes, waits hundreds (likewise when 200 clients vanish at once and
their runs end together). No step is long; there are just too many in a pass.

`Turns` bounds that: the CPU-heavy steps of a request (handing a new request
with a body to the HTTP parser, parsing and starting it, feeding each batch of
node events to its session and encoding it, ending its run) each take a turn
first, and at most `per_pass` turns are given in one pass. Past that, a step
waits, in arrival order, for a later pass. Light work (a GET, an idle
connection, the node connection's reads, timers) takes no turn and so runs
every pass: a pass lasts at most `per_pass` heavy steps plus the light work,
whatever the burst.

Nothing is lost or reordered within a request: a waiting step only runs later.
When the edge is not saturated, `turn()` returns at once without yielding;
past saturation, total throughput is what it was (the same steps run), and the
steps' extra wait is the fair share of a CPU that is full anyway.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

# At most this many heavy steps in one pass of the scheduler. A heavy step costs
# ~0.1-0.5 ms, so a pass spends at most a few ms on them; measured on the hostile
# mix's 200 stalled readers (BENCHMARKS.md): /healthz p99 398 ms -> 49-103 ms.
PER_PASS = 4


class _Waiter:
    __slots__ = ("event", "gone")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.gone = False  # cancelled while waiting: its turn goes to the next one


class Turns(trio.abc.Instrument):
    """At most `per_pass` heavy steps per scheduler pass; the rest wait in order.

    A trio instrument: each pass, once the scheduler has polled for I/O
    (`after_io_wait`), the budget starts again and goes to the steps waiting,
    first come first. `run()` must run (in a nursery that outlives the users): it
    installs the instrument and, only while steps wait, keeps the scheduler
    from sleeping in its I/O wait. When nothing waits, nothing runs per pass
    but the budget's reset: an idle edge sleeps in its I/O wait.
    """

    __slots__ = ("_on_defer", "_used", "_waiting", "_wake", "per_pass")

    def __init__(
        self, per_pass: int = PER_PASS, *, on_defer: Callable[[], object] | None = None
    ) -> None:
        """`on_defer` is called for each step that has to wait (a metric's `inc`)."""
        if per_pass < 1:
            raise ValueError("per_pass must be at least 1")
        self.per_pass = per_pass
        self._used = 0  # turns given in this pass
        self._waiting: deque[_Waiter] = deque()
        self._wake = trio.Event()  # wakes run() when a step starts waiting
        self._on_defer = on_defer

    @property
    def waiting(self) -> int:
        """Steps waiting for their turn now (including ones cancelled meanwhile)."""
        return len(self._waiting)

    async def turn(self) -> None:
        """Return when this step may run: at once, or in a later pass, in order."""
        if self._used < self.per_pass and not self._waiting:
            self._used += 1
            return
        waiter = _Waiter()
        self._waiting.append(waiter)
        if self._on_defer is not None:
            self._on_defer()
        self._wake.set()
        try:
            await waiter.event.wait()
        except BaseException:
            waiter.gone = True
            raise

    def after_io_wait(self, timeout: float) -> None:
        """A new pass: a new budget, first for the steps waiting (they run in this pass)."""
        self._used = 0
        waiting = self._waiting
        while waiting and self._used < self.per_pass:
            waiter = waiting.popleft()
            if not waiter.gone:
                self._used += 1
                waiter.event.set()

    async def run(self) -> None:
        """Install the per-pass budget; while steps wait, keep a task runnable so that
        the scheduler polls for I/O without sleeping and the next pass comes at once."""
        trio.lowlevel.add_instrument(self)
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                while self._waiting:
                    await trio.lowlevel.checkpoint()
        finally:
            trio.lowlevel.remove_instrument(self)
