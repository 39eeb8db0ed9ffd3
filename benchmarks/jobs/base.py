"""What every load-generator job shares: its line to the orchestrator, its type, its limits.

A job is a function `(ctl, **kwargs) -> result` run in a load-generator process
(`benchmarks.loadgen`); `benchmarks.jobs.JOBS` names them all.
"""

from __future__ import annotations

import multiprocessing.connection
import resource
from collections.abc import Callable
from typing import Any

JobFn = Callable[..., Any]


class Ctl:
    """A job's line to the orchestrator (for two-phase jobs)."""

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self._conn = conn

    def send(self, value: object) -> None:
        self._conn.send(("progress", value))

    def recv(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError("no instruction from the orchestrator")
        return self._conn.recv()


def raise_nofile(want: int = 65536) -> int:
    """Raise the soft RLIMIT_NOFILE as far as the hard limit allows; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(hard, want)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def max_backlog(rate: float) -> int:
    """Requests in flight past which a fixed-rate run stops: the target is saturated."""
    return max(50, int(rate * 0.25))
