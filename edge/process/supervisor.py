"""The supervisor of worker processes: `iop-edge --workers N` (`[server] workers`).

Owns: the listening sockets (bound once here, inherited by every worker), the
worker slots (`edge.process.workers`: each one's process, started, watched,
restarted with backoff when it dies), the signals of the edge (SIGTERM and SIGINT
drain every worker; a second one ends them at once; SIGHUP reloads), sd_notify
for the whole edge (ready once every slot is, alive while every worker pings),
and the edge's shared directory (`IOP_EDGE_SHARED_DIR`, with the metrics of every
process in it).
It serves no HTTP, opens no node connection, and knows nothing of requests.

A worker is `python -m edge <the same arguments> --worker-id I ...`: a fresh
interpreter (no fork of a process that holds threads or an event loop) that
runs the single-process daemon on the inherited sockets, on the configuration
the supervisor read: the supervisor keeps a copy of the file's bytes, and of every
file it names (key files, a node's token and TLS files), in the shared directory
(`config_copy`, named by their digest) and each worker parses that copy
(`--worker-config-digest`), not the files, so all of them, a worker restarted later
included, run the same bytes. On SIGHUP the supervisor reads and checks the file once: a mistake is
refused here (one log line, counted; the workers hear nothing of it), a good
file is copied and each worker is told `RELOAD=<digest>` on its socket
(`edge.process.reload` applies it there). A worker started later (one that died)
runs the last copy. It tells the supervisor it is ready and alive over a SOCK_SEQPACKET
socket pair, in sd_notify's own words (READY=1, WATCHDOG=1, STOPPING=1;
`edge.process.systemd.attach_supervisor`); when the supervisor goes away the worker
sees the end of that socket and drains. Workers run in a session of their
own, so a terminal's Ctrl-C reaches the supervisor only, which forwards it.

Listen modes (measured in BENCHMARKS.md, "Worker processes"; chosen by
$IOP_EDGE_LISTEN_MODE, for measurements). `shared` (the default) binds one
socket per address that every worker accepts from: whichever worker wakes
first takes the connection, and nothing is lost or kept waiting when one
dies (the queue is the kernel's, not the worker's). `reuseport` binds
one SO_REUSEPORT listening socket per worker slot, plus one bound socket per
address that never listens and holds the port for the edge's lifetime. The
kernel spreads new connections evenly over the listening sockets by their
addresses, whichever worker is idle. When a worker dies its slot's socket is
closed at once (the connections it had not accepted yet are reset, as they
would be if a single process died), so new connections go to the live
workers only, and its replacement gets a new socket. Measured on 2 workers,
both spread the load alike and serve alike; `shared` is the default for
what happens when a worker dies.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import trio
from loguru import logger

from edge.config import ConfigError, LoadedConfig, config_digest
from edge.config.files import bundle, files_digest, unbundle
from edge.config.toml import read_bytes
from edge.observe.log import count_dropped_lines
from edge.observe.logbound import clip
from edge.process import systemd
from edge.process.listeners import bind_listeners, listen_mode, url_of
from edge.process.signals import (
    IGNORED_SIGNALS,
    RELOAD_MESSAGE,
    RELOAD_SIGNAL,
    STOP_SIGNALS,
    drain_then_stop,
    exit_now,
)
from edge.process.workers import Slot

if TYPE_CHECKING:
    from edge.observe.metrics import SupervisorMetrics

# What the supervisor tells its workers through their environment, read back (once, by
# the daemon) with `shared_dir` and `metrics_dir`: the edge run's own directory, and the
# metrics directory in it (prometheus-client's variable: it reads it itself at import).
SHARED_DIR_ENV = "IOP_EDGE_SHARED_DIR"
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
# After the drain deadline and the workers' own hard stop: then they are killed.
_KILL_MARGIN_S = 5.0


def config_copy(shared: Path, digest: str) -> Path:
    """Where the supervisor keeps the configuration of `digest`: the bytes of its file
    and of the files it names (`edge.config.files.bundle`)."""
    return shared / f"config-{digest}.bundle"


def read_copy(shared: Path, digest: str) -> tuple[bytes, dict[str, bytes]]:
    """The configuration of `digest` as its supervisor read it: the file's bytes and
    those of the files it names. Raises ConfigError when the copy is missing, not a
    copy, or not of that digest (changed since it was checked)."""
    path = config_copy(shared, digest)
    try:
        data, files = unbundle(read_bytes(path))
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path}: not a configuration copy: {exc}") from None
    if files_digest(config_digest(data), files) != digest:
        raise ConfigError(f"{path}: its digest is not {digest}: changed since it was checked")
    return data, files


def shared_dir() -> Path | None:
    """This edge's shared directory (one per run, every worker sees the same); None
    in a single-process edge."""
    value = os.environ.get(SHARED_DIR_ENV)
    return Path(value) if value else None


def metrics_dir() -> Path | None:
    """Where prometheus-client keeps every process's values (its multiprocess mode);
    None: this process counts for itself alone."""
    value = os.environ.get(METRICS_ENV)
    return Path(value) if value else None


class WorkerStartError(Exception):
    """A worker ended before the edge was serving: the edge does not start."""


class Supervisor:
    """Runs `workers` worker processes of one edge until told to stop."""

    def __init__(
        self,
        loaded: LoadedConfig,
        worker_argv: Sequence[str],
        *,
        listen_mode: str = "shared",
        load: Callable[[], LoadedConfig] | None = None,
    ) -> None:
        config = loaded.config
        self.config = config
        # The configuration the workers run (the bytes of the file, their digest) and how
        # a reload reads it again.
        self.loaded = loaded
        self.load = load
        self._reloading = trio.Lock()
        self.workers = config.server.workers
        self.worker_argv = list(worker_argv)
        self.listen_mode = listen_mode
        self.stopping = trio.Event()
        self.slots: list[Slot] = []
        self.failed = False
        # How often a worker says WATCHDOG=1 (None: systemd watches no process here).
        self.heartbeat_s: float | None = None
        self._metrics: SupervisorMetrics | None = None
        self._shared: Path | None = None
        # The sockets bound here (a reuseport slot's own, bound again, are its own).
        self._bound: list[socket.socket] = []
        self._nursery: trio.Nursery | None = None
        self._url = ""

    # --- lifetime ---------------------------------------------------------------------

    def prepare(self) -> str:
        """The shared directory and the listening sockets; returns the edge's URL.

        Before anything imports prometheus-client: its multiprocess mode is chosen
        from the environment at import.
        """
        self._shared = Path(tempfile.mkdtemp(prefix="iop-edge-"))
        (self._shared / "metrics").mkdir()
        os.environ[SHARED_DIR_ENV] = str(self._shared)
        os.environ[METRICS_ENV] = str(self._shared / "metrics")
        self._keep_copy(self.loaded)
        copies = self.workers if self.listen_mode == "reuseport" else 1
        groups, holders = bind_listeners(self.config.server.listen, copies)
        self._bound = [*holders, *(s for g in groups for s in g)]
        from edge.observe.metrics import SupervisorMetrics

        self._metrics = SupervisorMetrics()
        count_dropped_lines(self._metrics.log_lines_dropped.inc)
        self.slots = [
            Slot(self, self._metrics, i + 1, groups[i % len(groups)], copies > 1)
            for i in range(self.workers)
        ]
        return url_of(groups[0][0])

    def _keep_copy(self, loaded: LoadedConfig) -> None:
        """The bytes of `loaded`'s file, for the workers (written whole, then renamed)."""
        assert self._shared is not None
        path = config_copy(self._shared, loaded.digest)
        partial = path.with_suffix(".part")
        partial.write_bytes(bundle(loaded.data, loaded.files))
        partial.replace(path)

    def cleanup(self) -> None:
        self._close_sockets()
        if self._shared is not None:
            shutil.rmtree(self._shared, ignore_errors=True)

    def _close_sockets(self) -> None:
        for sock in [*self._bound, *(s for slot in self.slots for s in slot.sockets)]:
            sock.close()  # (a socket closed already: nothing happens)

    async def run(self, url: str, hard_stop_s: float) -> int:
        """Serve with every worker until a stop signal, then drain them; the exit code."""
        self._url = url
        interval = systemd.watchdog_interval()
        if interval is not None:
            self.heartbeat_s = interval / 2
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._signals, hard_stop_s)
            async with trio.open_nursery() as running:
                for slot in self.slots:
                    running.start_soon(slot.keep)
            nursery.cancel_scope.cancel()
        logger.info("iop-edge stopped ({} workers)", self.workers)
        return 1 if self.failed else 0

    def slot_ready(self, slot: Slot) -> None:
        """Slot's first READY=1; once every slot has said it, the edge is ready."""
        slot.started = True
        if self.stopping.is_set() or not all(s.started for s in self.slots):
            return
        logger.info("iop-edge serving on {} ({} workers)", self._url, self.workers)
        systemd.notify(f"READY=1\nSTATUS=serving ({self.workers} workers)")
        interval = systemd.watchdog_interval()
        if interval is not None and self._nursery is not None:
            self._nursery.start_soon(self._watchdog, interval)

    # --- the edge as a whole ------------------------------------------------------------

    def alive(self, within_s: float) -> bool:
        """Every worker runs, has said READY=1, and was heard from within `within_s`."""
        now = trio.current_time()
        return all(
            s.process is not None and s.process.returncode is None and s.serving
            and now - s.last_seen <= within_s
            for s in self.slots
        )  # fmt: skip

    async def _watchdog(self, interval: float) -> None:
        """WATCHDOG=1 to systemd while every worker is alive and pinging."""
        while True:
            if self.alive(2 * interval):
                systemd.notify("WATCHDOG=1")
            await trio.sleep(interval)

    def stop(self) -> None:
        """Drain: no more restarts, SIGTERM to every worker; the sockets here are closed."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        systemd.notify("STOPPING=1\nSTATUS=draining")
        self._close_sockets()
        self._send(signal.SIGTERM)

    def _send(self, signum: int) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.process.send_signal(signum)

    async def reload(self) -> bool:
        """SIGHUP: read and check the file once; a good one is copied for the workers and
        each is told to switch to it. False: refused (or stopping), nothing changed."""
        async with self._reloading:
            if self.stopping.is_set() or self.load is None:
                return False
            assert self._metrics is not None
            try:
                loaded = await trio.to_thread.run_sync(self.load)
                self._keep_copy(loaded)
            except (ConfigError, OSError) as exc:
                self._metrics.config_reloads.labels("error").inc()
                logger.error(
                    "reload refused, the workers keep the configuration in use ({}): {}",
                    self.loaded.digest, clip(str(exc)),
                )  # fmt: skip
                return False
            self.loaded = loaded
            logger.info(
                "configuration {} checked: {} workers reload it", loaded.digest, self.workers
            )
            message = f"{RELOAD_MESSAGE}{loaded.digest}".encode()
            for slot in self.slots:
                if slot.control is None:
                    continue  # starting again: it reads the new copy
                with trio.move_on_after(1.0):  # a worker that stopped reading: it is dying
                    try:
                        await slot.control.send(message)
                    except OSError as exc:
                        logger.warning("worker {}: cannot ask it to reload: {}", slot.index, exc)
            return True

    async def _signals(self, hard_stop_s: float) -> None:
        with trio.open_signal_receiver(*STOP_SIGNALS, RELOAD_SIGNAL, *IGNORED_SIGNALS) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == RELOAD_SIGNAL:
                    if self.stopping.is_set():
                        logger.info("SIGHUP: ignored while draining")
                    elif self._nursery is not None:
                        logger.info("SIGHUP: reloading the configuration")
                        self._nursery.start_soon(self.reload)
                    continue
                if signum in IGNORED_SIGNALS:
                    logger.info("{}: ignored (SIGHUP reloads; SIGTERM drains and stops)", name)
                    continue
                if self.stopping.is_set():
                    logger.warning("second signal: stopping every worker now")
                    self._send(signal.SIGINT)  # a worker's "exit now"
                    self.failed = True
                    continue
                logger.info("{}: draining {} workers", name, self.workers)
                drain_then_stop(self.stop, hard_stop_s + _KILL_MARGIN_S, self._hard_stop)

    def _hard_stop(self) -> None:
        """A worker outlived its own hard stop: kill what is left, and leave."""
        logger.error("workers still running after the drain deadline: killing them")
        self._send(signal.SIGKILL)
        self.cleanup()
        exit_now(1)


def serve_workers(
    loaded: LoadedConfig,
    worker_argv: Sequence[str],
    hard_stop_s: float,
    load: Callable[[], LoadedConfig] | None = None,
) -> int:
    """The supervisor's main: bind, start the workers, serve until stopped; the exit code.
    `load` reads the configuration again (a reload).

    Raises OSError when the listen address cannot be bound.
    """
    supervisor = Supervisor(loaded, worker_argv, listen_mode=listen_mode(), load=load)
    try:
        url = supervisor.prepare()
        return trio.run(supervisor.run, url, hard_stop_s)
    finally:
        supervisor.cleanup()
