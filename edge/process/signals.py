"""The edge's signals: which ones stop it, which ones it ignores, what each does in a
single process and in a worker, and the hard stop past the drain.

SIGTERM and SIGINT drain (a second one exits at once). SIGHUP, SIGUSR1 and SIGUSR2,
whose default action would end the process on the spot (no drain, no CancelRun), are
logged and otherwise ignored: the edge has no reload, and a stray `kill -HUP` or a
closed terminal must not cut streams. SIGPIPE stays ignored as Python sets it at
start: a write to a socket the peer closed fails for that connection only.

In a worker (`edge.process.supervisor` starts them) SIGTERM drains (a repeat is
ignored: systemd may send it to every process of the service as well as the
supervisor forwarding it), SIGINT (the supervisor's second signal) exits at once,
and the end of the supervisor's socket drains too. The supervisor receives its own
signals, and starts its drain with `drain_then_stop` like the others.

Used by the command line (`edge.cli`) and the supervisor, so neither imports the
other for them; knows nothing of what is drained (it sets an event, or calls back).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable
from functools import partial

import trio
from loguru import logger

from edge.observe.log import flush_logs

# After the drain deadline: time for the notices and the CancelRuns to go out.
HARD_STOP_GRACE_S = 15.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
IGNORED_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def exit_now(code: int) -> None:
    """Leave at once: a client that stopped reading can hold a shielded socket
    write (hypercorn's) forever, so no graceful path is guaranteed to end."""
    flush_logs(timeout_s=1.0)  # a stuck reader of the log does not hold the exit
    os._exit(code)


def _hard_stop(after_s: float) -> None:
    logger.error("still running {}s after the shutdown signal: exiting", after_s)
    exit_now(1)


def drain_then_stop(
    start_draining: Callable[[], None],
    after_s: float,
    hard_stop: Callable[[], None] | None = None,
) -> None:
    """Start draining, and past `after_s` (the drain and the grace for closing), stop
    whatever still holds on: `hard_stop` (by default: log and exit this process), from
    a daemon thread, so a loop that no longer runs cannot hold it."""
    start_draining()
    timer = threading.Timer(after_s, hard_stop or partial(_hard_stop, after_s))
    timer.daemon = True
    timer.start()


async def daemon_signals(shutdown: trio.Event, hard_stop_s: float) -> None:
    """A single-process edge's signals: the first stop signal drains, a second exits."""
    with trio.open_signal_receiver(*STOP_SIGNALS, *IGNORED_SIGNALS) as signals:
        async for signum in signals:
            if signum in IGNORED_SIGNALS:
                logger.info(
                    "{}: ignored (there is no reload; SIGTERM drains and stops)",
                    signal.Signals(signum).name,
                )
                continue
            if shutdown.is_set():
                logger.warning("second signal: exiting now")
                exit_now(1)
            logger.info("{}: draining", signal.Signals(signum).name)
            drain_then_stop(shutdown.set, hard_stop_s)


async def worker_signals(
    shutdown: trio.Event, *, control: socket.socket, hard_stop_s: float
) -> None:
    """A worker's signals (see the module's docstring), and its supervisor's end."""

    def drain(why: str) -> None:
        if shutdown.is_set():
            return
        logger.info("{}: draining", why)
        drain_then_stop(shutdown.set, hard_stop_s)

    async def watch_supervisor() -> None:
        await trio.lowlevel.wait_readable(control)  # it never writes: this is its end
        logger.warning("the supervisor is gone")
        drain("supervisor gone")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_supervisor)
        with trio.open_signal_receiver(*STOP_SIGNALS, *IGNORED_SIGNALS) as signals:
            async for signum in signals:
                if signum == signal.SIGINT:
                    logger.warning("SIGINT from the supervisor: exiting now")
                    exit_now(1)
                elif signum == signal.SIGTERM:
                    drain("SIGTERM")
                else:
                    logger.info("{}: ignored", signal.Signals(signum).name)


def ignore_signals() -> None:
    """Until the daemon's receiver takes them over (and after it), these do nothing."""
    for signum in IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
