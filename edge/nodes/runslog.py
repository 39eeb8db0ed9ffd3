"""A node's runs: the record of each from Run to its runs-log line, and the runs log.

`RunsLog` holds the runs in flight and writes the runs log, one JSON line per run
when it ends: run_id, model, outcome, cancel_rpc, cancel_rpcs, events_sent,
started_at, ended_at. A run that ended without CancelRun waits CANCEL_GRACE_S for
one (a CancelRun races the stream reset) before its line is written; a CancelRun
for an id the node does not know is logged as {"type": "cancel_rpc", "found":
false, "at": <unix time>}. A run id served again on the node (an answer moved back
to it) writes the earlier run's line at once: each run has its own.
In-process users read the last FINISHED_KEPT records (`RunsLog.finished`); a node
keeps nothing per run beyond that window, however long it serves.

Node side only (asyncio); `edge.nodes.kit` serves runs with it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from grpclib.server import Stream

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.codec import Serialized

# How long a run that ended without CancelRun waits for one before its line is written.
CANCEL_GRACE_S = 1.0
# The runs-log records a node keeps in memory for in-process users (the file gets
# every one): a window, so that a node serving for months holds no record per run.
FINISHED_KEPT = 1000

Events = Stream[pb.RunRequest, pb.RunEvent]


@dataclass(slots=True)
class RunRecord:
    """One run on a node, from Run to its runs-log line."""

    run_id: str
    model: str
    # What CancelRun waits for (the handler's task, or a task of its own), and what it
    # calls to stop the run (the task's cancel, unless the node stops it its own way).
    task: asyncio.Task[Any] | None = None
    stop: Callable[[], object] | None = field(default=None, repr=False)
    events_sent: int = 0
    cancel_rpcs: int = 0
    outcome: str | None = None
    flush_handle: asyncio.TimerHandle | None = field(default=None, repr=False)
    # Wall-clock seconds (comparable across nodes): when the run began and ended here.
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    # Where the run's events go while it is served (dropped when it ends).
    stream: Events | None = field(default=None, repr=False)
    # Whether its runs-log line was written (once).
    written: bool = False

    async def send(self, event: pb.RunEvent | Serialized) -> None:
        """Send one event of the run, counted in its runs-log line (`events_sent`)."""
        if self.stream is None:
            raise RuntimeError(f"run {self.run_id} has ended: it sends no more events")
        await self.stream.send_message(event)
        self.events_sent += 1


class RunsLog:
    """The runs of one node: which are live, and the log line of each that ended."""

    def __init__(self, path: Path | None = None) -> None:
        self._runs: dict[str, RunRecord] = {}
        self._file: IO[str] | None = path.open("a", buffering=1) if path else None
        # The last FINISHED_KEPT records written, for in-process users.
        self.finished: deque[dict[str, Any]] = deque(maxlen=FINISHED_KEPT)

    @property
    def active(self) -> int:
        return sum(1 for run in self._runs.values() if run.outcome is None)

    def start(self, run_id: str, model: str, stream: Events | None = None) -> RunRecord:
        """Record a run that began (its events go to `stream`)."""
        earlier = self._runs.get(run_id)
        if earlier is not None and earlier.flush_handle is not None:
            # The same run id again (an answer moved back to this node): the earlier
            # run's line is written now, and a CancelRun from here is the new run's.
            earlier.flush_handle.cancel()
            self._flush(earlier)
        run = RunRecord(run_id, model, stream=stream)
        self._runs[run_id] = run
        return run

    def cancel_rpc(self, run_id: str) -> tuple[RunRecord | None, bool]:
        """Record a CancelRun. Returns (the live run to stop or None, whether it was live)."""
        run = self._runs.get(run_id)
        if run is None:
            self._write({"type": "cancel_rpc", "run_id": run_id, "found": False, "at": time.time()})
            return None, False
        run.cancel_rpcs += 1
        if run.outcome is None:
            return run, True
        if run.flush_handle is not None:
            # Ended already (the stream reset came first): record now, not after the grace.
            run.flush_handle.cancel()
            self._flush(run)
        return None, False

    def ended(self, run: RunRecord) -> None:
        """The run is over (its outcome set): write its line now, or after the grace."""
        run.task = None
        run.stop = None
        run.stream = None
        run.ended_at = time.time()
        if run.outcome in ("complete", "error") or run.cancel_rpcs:
            self._flush(run)
        else:
            loop = asyncio.get_running_loop()
            run.flush_handle = loop.call_later(CANCEL_GRACE_S, self._flush, run)

    def _flush(self, run: RunRecord) -> None:
        """Write `run`'s line, once; its id is let go unless a newer run holds it."""
        if run.written:
            return
        run.written = True
        if self._runs.get(run.run_id) is run:
            del self._runs[run.run_id]
        self._write(
            {
                "run_id": run.run_id,
                "model": run.model,
                "outcome": run.outcome,
                "cancel_rpc": run.cancel_rpcs > 0,
                "cancel_rpcs": run.cancel_rpcs,
                "events_sent": run.events_sent,
                "started_at": run.started_at,
                "ended_at": run.ended_at,
            }
        )

    def _write(self, record: dict[str, Any]) -> None:
        self.finished.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Write the lines still waiting for their grace, then close the file."""
        for run in list(self._runs.values()):
            if run.flush_handle is not None:
                run.flush_handle.cancel()
                self._flush(run)
        if self._file is not None:
            self._file.close()
            self._file = None
