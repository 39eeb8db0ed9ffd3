"""One request's answer, from its first pick to its last byte: `Answer`.

The HTTP layer opens an `Answer` around a chat request's whole cycle, starts
it once the request is parsed, and observes it; nothing here calls back up:

    answer = Answer()
    async with answer.serve():                          # its nursery, around the cycle
        committed = await failover.start(answer, plan, new_session)
        batch = await answer.next_batch()               # until answer.session.terminated
        await answer.end()                              # the outcome fixed: answer.run.outcome

The answer owns its nursery (each run's node read task lives there, its
CancelRun included: nothing of a run outlives its request), its attempts
(`edge.fleet.failover` tries other nodes before the commit point;
`edge.fleet.migration` moves it after, `leg` is the run answering now), the
node slot each run holds (given back with the run's outcome), the run whose
outcome is the request's (`run`, once adopted), what it holds of the memory
budget (`at_end`), and a journal of what happened to it (`journal`: queued,
picked, retried, accepted, start failed, migrated) that the HTTP layer turns
into the request's span. Each run's own life is `edge.fleet.run.Run`'s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Literal, NamedTuple, Protocol

import trio

from edge.fleet.run import Run
from edge.stream.output import ErrorOut, Outcome, OutEvent, RoleOut
from edge.stream.session import StreamSession


class Mark(NamedTuple):
    """One thing that happened to an answer, at trio time `at` (its journal)."""

    what: Literal["queued", "picked", "retried", "accepted", "start_failed", "migrated"]
    at: float
    node: str = ""
    # A retry's verdict, a migration's reason, a start's error type.
    why: str = ""
    to_node: str = ""  # where a migration went
    attempt: int = 0  # a pick's attempt number (1: the first)
    chars: int = 0  # a migration's characters delivered before it


class Moves(Protocol):
    """How an answer moves after output: `edge.fleet.migration.Mover`, which imports
    this module (so named here, not imported)."""

    async def move(self, answer: Answer) -> bool:
        """Continue `answer`'s broken run on another node; False: it does not move."""

    def resumed(self, gap_s: float) -> None:
        """The moved answer's first event came `gap_s` after its break."""


def _is_output(batch: list[OutEvent]) -> bool:
    """Whether `batch` holds the answer's output (an error frame is its terminal)."""
    return any(type(event) not in (RoleOut, ErrorOut) for event in batch)


class Answer:
    """One request's answer (see the module doc)."""

    __slots__ = ("_nursery", "_stack", "attempts", "gap_from", "journal", "leg", "mover",
                 "queue_s", "run")  # fmt: skip

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None
        self._stack = AsyncExitStack()
        self.attempts: list[Run] = []  # every run entered, in order
        self.leg: Run | None = None  # the run answering now
        self.run: Run | None = None  # the run whose outcome is the request's (adopted)
        self.journal: list[Mark] = []
        self.queue_s = 0.0  # how long the request waited for its first node slot
        # Its way to move after output (`edge.fleet.migration`); None: it cannot.
        self.mover: Moves | None = None
        # When the answer moved from a broken run (trio time), until the new run's first event.
        self.gap_from: float | None = None

    @property
    def nursery(self) -> trio.Nursery:
        assert self._nursery is not None, "inside Answer.serve"
        return self._nursery

    @property
    def session(self) -> StreamSession:
        assert self.leg is not None, "an answer started"
        return self.leg.session

    @property
    def outcome(self) -> Outcome | None:
        """The request's outcome, once the run that answers it has ended."""
        return self.run.outcome if self.run is not None else None

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[Answer]:
        """Around the request's cycle, in its task: the nursery, then the runs held (each
        ended when the cycle ends, however it ends), then what `at_end` was given."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                async with self._stack:
                    yield self
        finally:
            self._nursery = None
            self.mover = None  # it holds the request's RunRequest
            for run in self.attempts:  # their read tasks (and CancelRuns) are over
                run.retire()

    def at_end(self, callback: Callable[[], object]) -> None:
        """Call `callback` when the request's cycle ends, however it ends (after its runs:
        what they hold is given back once they are over)."""
        self._stack.callback(callback)

    async def hold(self, run: Run) -> None:
        """Enter `run` (start it on its node) for the rest of the request's cycle."""
        self.attempts.append(run)
        node = run.info.node
        self.journal.append(Mark("picked", run.info.started_at, node, attempt=len(self.attempts)))
        try:
            await self._stack.enter_async_context(run)
        except BaseException as exc:
            why = getattr(exc, "type", None) or type(exc).__name__
            self.journal.append(Mark("start_failed", trio.current_time(), node, str(why)))
            raise
        self.journal.append(Mark("accepted", trio.current_time(), node))

    def adopt(self, run: Run) -> None:
        """`run` answers the request: its outcome is the request's."""
        self.run = run

    async def first_batch(self) -> tuple[list[OutEvent], bool]:
        """The output up to the point where the answer's HTTP status is committed, from
        whichever run answers (moved if the run breaks where its answer may move).

        Batches are taken until one holds more than the role chunk (a stream; a
        non-streaming answer: until the session terminates, its status is committed
        when it is whole), the session terminates, or a keep-alive is due; returns
        what was taken and whether a keep-alive is due. Nothing of it was sent yet:
        a run that failed here (`Run.failed_over`) can still be tried elsewhere or
        answered with a status.
        """
        taken: list[OutEvent] = []
        assert self.leg is not None
        stream = self.leg.info.stream
        while True:
            batch = await self.next_batch()
            if batch == "keepalive":
                self.leg.reader.head_sent = True
                return taken, True
            taken.extend(batch)
            if _is_output(batch):
                self.leg.reader.output_seen = True
                if stream:
                    return taken, False
            if self.session.terminated:
                return taken, False

    async def next_batch(self) -> list[OutEvent] | Literal["keepalive"]:
        """The next batch of the answer (see `RunReader.next_batch`), from whichever run
        answers it now: a run that breaks after output hands the answer to another node
        when it may move (`Mover.move`), else its break ends the answer."""
        leg = self.leg
        assert leg is not None
        reader = leg.reader
        batch = await reader.next_batch()
        mover = self.mover
        if self.gap_from is not None and reader.first_event_at is not None:
            assert mover is not None
            mover.resumed(reader.first_event_at - self.gap_from)
            self.gap_from = None
        if reader.broke is None:
            return batch
        out = [] if batch == "keepalive" else batch
        if _is_output(out):
            reader.output_seen = True  # (as `first_batch` would: its verdict is after output)
        shown = reader.output_seen or reader.head_sent
        if mover is None or not (shown or not leg.info.stream) or not await mover.move(self):
            leg.end_break()
        return out + self.session.drain()

    async def end(self) -> None:
        """End the run answering now (see `Run.end`); a broken one already ended."""
        if self.leg is not None:
            await self.leg.end()
