"""The edge's signals: which ones stop it, which one reloads it, which ones it ignores,
what each does in a single process and in a worker, and the hard stop past the drain.

SIGTERM and SIGINT drain (a second one exits at once). SIGHUP reloads the
configuration (`edge.process.reload`; ignored while draining). SIGUSR1 and
SIGUSR2, whose default action would end the process on the spot (no drain, no
CancelRun), are logged and otherwise ignored: a stray signal must not cut streams.
Until the receiver runs (and after it), SIGHUP is ignored too. SIGPIPE stays
ignored as Python sets it at start: a write to a socket the peer closed fails for
that connection only.

In a worker (`edge.process.supervisor` starts them) SIGTERM drains (a repeat is
ignored: systemd may send it to every process of the service as well as the
supervisor forwarding it), SIGINT (the supervisor's second signal) exits at once,
and the end of the supervisor's socket drains too. A worker reloads when its
supervisor says so on that socket (`RELOAD=<digest>`: the file it checked), not on
a SIGHUP of its own (logged and ignored). The supervisor receives its own signals,
and starts its drain with `drain_then_stop` like the others.

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
RELOAD_SIGNAL = signal.SIGHUP
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# A supervisor's word to its worker: reload from the copy of the file of this digest.
RELOAD_MESSAGE = "RELOAD="
# What a reload is asked with: the digest a supervisor checked (None: read the file).
Reload = Callable[[str | None], None]


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


async def daemon_signals(shutdown: trio.Event, reload: Reload, hard_stop_s: float) -> None:
    """A single-process edge's signals: the first stop signal drains, a second exits;
    SIGHUP asks for a reload."""
    with trio.open_signal_receiver(*STOP_SIGNALS, RELOAD_SIGNAL, *IGNORED_SIGNALS) as signals:
        async for signum in signals:
            if signum == RELOAD_SIGNAL:
                if shutdown.is_set():
                    logger.info("SIGHUP: ignored while draining")
                else:
                    logger.info("SIGHUP: reloading the configuration")
                    reload(None)
                continue
            if signum in IGNORED_SIGNALS:
                logger.info(
                    "{}: ignored (SIGHUP reloads; SIGTERM drains and stops)",
                    signal.Signals(signum).name,
                )
                continue
            if shutdown.is_set():
                logger.warning("second signal: exiting now")
                exit_now(1)
            logger.info("{}: draining", signal.Signals(signum).name)
            drain_then_stop(shutdown.set, hard_stop_s)


async def worker_signals(
    shutdown: trio.Event, reload: Reload, *, control: socket.socket, hard_stop_s: float
) -> None:
    """A worker's signals (see the module's docstring), and its supervisor's words: a
    reload, or its end."""

    def drain(why: str) -> None:
        if shutdown.is_set():
            return
        logger.info("{}: draining", why)
        drain_then_stop(shutdown.set, hard_stop_s)

    async def watch_supervisor() -> None:
        while True:
            await trio.lowlevel.wait_readable(control)
            try:
                data = control.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:  # the supervisor's end of the socket is closed
                break
            for line in data.decode(errors="replace").splitlines():
                if line.startswith(RELOAD_MESSAGE) and not shutdown.is_set():
                    reload(line.removeprefix(RELOAD_MESSAGE))
        logger.warning("the supervisor is gone")
        drain("supervisor gone")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_supervisor)
        with trio.open_signal_receiver(*STOP_SIGNALS, RELOAD_SIGNAL, *IGNORED_SIGNALS) as signals:
            async for signum in signals:
                if signum == signal.SIGINT:
                    logger.warning("SIGINT from the supervisor: exiting now")
                    exit_now(1)
                elif signum == signal.SIGTERM:
                    drain("SIGTERM")
                elif signum == RELOAD_SIGNAL:
                    logger.info("SIGHUP: ignored (a worker reloads when its supervisor says so:"
                                " send SIGHUP to the supervisor)")  # fmt: skip
                else:
                    logger.info("{}: ignored", signal.Signals(signum).name)


def ignore_signals() -> None:
    """Until the daemon's receiver takes them over (and after it), these do nothing."""
    for signum in (RELOAD_SIGNAL, *IGNORED_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)
