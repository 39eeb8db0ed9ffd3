"""The load generator: worker processes that run one job at a time for the orchestrator.

`Pool` starts `n` worker processes (multiprocessing, spawn) and talks to each over a
pipe: `submit(i, job, **kwargs)` then `result(i)`. A job is a function in
`benchmarks.jobs.JOBS`; the asyncio jobs (`benchmarks.jobs.aio`) drive the edge over raw
HTTP/1.1 (`benchmarks.httpclient`); the trio jobs in `benchmarks.jobs.direct` drive the
node through the edge's own node client. Each job
reports its own CPU time, so the client's cost is known beside the server's. A job that
needs a second instruction (hold streams open, then close them) reads it from its pipe.

Every job is bounded: its requests by count, its waiting by `timeout_s`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import signal
import time
import traceback
from typing import Any

from benchmarks.cleanup import die_with_parent
from benchmarks.jobs.base import Ctl, JobFn, raise_nofile

mono = time.monotonic


def _worker(conn: multiprocessing.connection.Connection) -> None:
    # The orchestrator stops its workers (`Pool.close`): a Ctrl-C at the terminal is its
    # to handle, and its death, even by SIGKILL, ends them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    raise_nofile()
    from benchmarks.jobs import JOBS

    jobs: dict[str, JobFn] = JOBS
    ctl = Ctl(conn)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        name, kwargs = message
        try:
            result = jobs[name](ctl, **kwargs)
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class Pool:
    """`n` load-generator processes; stopped (terminate, then kill) by `close()`."""

    def __init__(self, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child,), name=f"bench-client-{i}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    @property
    def size(self) -> int:
        return len(self.conns)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def submit(self, i: int, job: str, **kwargs: Any) -> None:
        self.conns[i].send((job, kwargs))

    def spread(self, workers: int, job: str, count: int, **kwargs: Any) -> None:
        """`job` on clients 0..workers-1, `count` split among them as evenly as can be."""
        for i in range(workers):
            self.submit(i, job, count=count // workers + (i < count % workers), **kwargs)

    def send(self, i: int, value: object) -> None:
        self.conns[i].send(value)

    def ready(self, i: int, timeout_s: float) -> bool:
        """Whether client i has an answer, waiting at most timeout_s."""
        return self.conns[i].poll(timeout_s)

    def result(self, i: int, timeout_s: float) -> Any:
        """The job's result (or its next progress report); raises on error or timeout."""
        conn = self.conns[i]
        try:
            if not conn.poll(timeout_s):
                raise TimeoutError(f"client {i}: no answer within {timeout_s:.0f} s")
            kind, value = conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"client {i} died: {exc!r}") from exc
        if kind == "error":
            raise RuntimeError(f"client {i} failed:\n{value}")
        return value

    def run(self, job: str, wait_s: float, **kwargs: Any) -> Any:
        """Run `job` on client 0 and wait (at most `wait_s`) for its result."""
        self.submit(0, job, **kwargs)
        return self.result(0, wait_s)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = mono() + 3.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - mono()))
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
