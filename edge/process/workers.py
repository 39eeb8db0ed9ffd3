"""One worker slot of `iop-edge --workers N`: its process, started, watched and restarted.

Owns a slot's life (`Slot`): its worker process (`python -m edge <the same
arguments> --worker-id I ...`, in a session of its own, on the slot's inherited
sockets), the socket pair over which the worker speaks sd_notify's words
(READY=1, WATCHDOG=1), the restart with backoff when it dies, and in reuseport
mode the slot's own sockets (closed while it has no worker, bound again for the
next one). What the edge as a whole does (readiness, the stop, reloads, signals)
is the supervisor's (`edge.process.supervisor`), which a slot sees as `SlotHost`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Protocol

import trio
from loguru import logger

from edge.config import LoadedConfig
from edge.process.listeners import addresses, rebind

if TYPE_CHECKING:
    from edge.observe.metrics import SupervisorMetrics

# A worker that died is started again after base * 2**(deaths in a row), at most cap.
RESTART_BACKOFF_S = (0.1, 30.0)
# A worker that served this long since it was ready resets its deaths in a row.
STABLE_S = 30.0
# Environment a worker must not see: systemd speaks to the supervisor only.
_SYSTEMD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


class SlotHost(Protocol):
    """What a worker slot reads of its supervisor, and what it tells it."""

    stopping: trio.Event  # set: no more restarts, every worker drains
    failed: bool  # the edge exits with 1
    loaded: LoadedConfig  # the configuration a worker started now runs (its digest)
    worker_argv: list[str]  # the command's own arguments, the same for every worker
    heartbeat_s: float | None  # how often a worker says WATCHDOG=1 (None: it does not)

    def stop(self) -> None:
        """Drain every worker: a worker ended before the edge was serving."""

    def slot_ready(self, slot: Slot) -> None:
        """The slot's worker said READY=1, the first of the slot's workers to say it."""


class Slot:
    """Worker I: its sockets, its current process, and how it has fared."""

    def __init__(
        self,
        host: SlotHost,
        metrics: SupervisorMetrics,
        index: int,
        sockets: list[socket.socket],
        own: bool,
    ) -> None:
        self._host = host
        self._metrics = metrics
        self.index = index
        self.sockets = sockets
        # reuseport: the slot's own sockets, closed while it has no worker (so the kernel
        # sends new connections to the live workers), bound again for the next one.
        self.own = own
        self.addresses = addresses(sockets)
        self.process: trio.Process | None = None
        # Its current process said READY=1 (and has not ended).
        self.serving = False
        # Some process of this slot has been ready once (the edge started).
        self.started = False
        self.last_seen = 0.0
        self.deaths = 0  # in a row, without STABLE_S of service between them
        # The supervisor's end of its current process's socket (None: no process).
        self.control: trio.socket.SocketType | None = None

    async def keep(self) -> None:
        """Run the slot's worker, and again after it dies (with backoff), until stopping."""
        host = self._host
        while not host.stopping.is_set():
            code, lived_s = await self._run_once()
            if host.stopping.is_set():
                if code != 0:
                    host.failed = True
                    logger.warning("worker {} exited with {}", self.index, _describe(code))
                return
            if not self.started:
                logger.error(
                    "worker {} exited with {} before it was ready: stopping",
                    self.index, _describe(code),
                )  # fmt: skip
                host.failed = True
                host.stop()
                return
            self.deaths = 0 if lived_s >= STABLE_S else self.deaths + 1
            delay = min(RESTART_BACKOFF_S[0] * 2 ** max(0, self.deaths - 1), RESTART_BACKOFF_S[1])
            self._metrics.restarts.inc()
            logger.error(
                "worker {} exited with {}: restarting it in {:g}s",
                self.index, _describe(code), delay,
            )  # fmt: skip
            with trio.move_on_after(delay):
                await host.stopping.wait()

    async def _run_once(self) -> tuple[int, float]:
        """One process of the slot, from start to exit: (exit code, seconds served)."""
        host = self._host
        if self.own and not self.sockets:
            try:
                self.sockets = rebind(self.addresses)
            except OSError as exc:  # the fd limit, say: try again after the backoff
                logger.error("worker {}: cannot listen again: {}", self.index, exc)
                return 255, 0.0
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [s.fileno() for s in self.sockets]
        argv = [
            sys.executable, "-m", "edge", *host.worker_argv,
            "--worker-id", str(self.index),
            "--worker-fds", ",".join(map(str, fds)),
            "--worker-control", str(theirs.fileno()),
            "--worker-config-digest", host.loaded.digest,
        ]  # fmt: skip
        if host.heartbeat_s is not None:
            argv += ["--worker-heartbeat-s", f"{host.heartbeat_s:g}"]
        env = {k: v for k, v in os.environ.items() if k not in _SYSTEMD_ENV}
        try:
            process = await trio.lowlevel.open_process(
                argv, pass_fds=[*fds, theirs.fileno()], env=env,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            logger.error("worker {}: cannot start: {}", self.index, exc)
            mine.close()
            return 255, 0.0
        finally:
            theirs.close()
        self.process = process
        if host.stopping.is_set():  # stopped while it was being started
            process.send_signal(signal.SIGTERM)
        self._metrics.workers.inc()
        ready_at: list[float] = []
        control = trio.socket.from_stdlib_socket(mine)
        self.control = control
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._listen, control, ready_at)
                code = await process.wait()
                nursery.cancel_scope.cancel()
        finally:
            self.control = None
            control.close()
            self._metrics.workers.dec()
            self.serving = False
            if self.own:  # what its queue holds is lost with it; new connections go on
                for sock in self.sockets:
                    sock.close()
                self.sockets = []
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(process.pid)  # type: ignore[no-untyped-call]
        lived_s = trio.current_time() - ready_at[0] if ready_at else 0.0
        return code, lived_s

    async def _listen(self, control: trio.socket.SocketType, ready_at: list[float]) -> None:
        """The worker's sd_notify lines: READY=1 (once), WATCHDOG=1 (each heartbeat)."""
        while True:
            try:
                data = await control.recv(4096)
            except OSError:
                return
            if not data:
                return
            now = trio.current_time()
            lines = data.decode(errors="replace").splitlines()
            if "READY=1" in lines and not ready_at:
                ready_at.append(now)
                self.last_seen = now
                self.serving = True
                if self.started:
                    logger.info("worker {} is serving again", self.index)
                else:
                    self._host.slot_ready(self)
            if "WATCHDOG=1" in lines:
                self.last_seen = now


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
