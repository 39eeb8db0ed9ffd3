"""The real processes of a chaos run: `iop-sim-node`s and an `iop-edge`, on 127.0.0.1.

Starts them as subprocesses (output to files in the run's work directory,
never to a pipe nobody reads), kills and restarts nodes on their port, reads
the edge's resource figures, and stops everything with a bounded wait. Every
wait here is bounded in time; nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psutil  # type: ignore[import-untyped]
import trio

from benchmarks.cleanup import kill_group, kill_left
from tests.chaos.plan import FIRST_EVENT_S, IDLE_S, KEEPALIVE_S, TOTAL_S
from tests.chaos.probe import EVERY_S, HEALTHZ_REQUEST

START_TIMEOUT_S = 30.0
# Our own probes close their connections: an idle keep-alive connection the
# client closes stays open in hypercorn's trio worker until keep_alive_timeout
# (see docs/chaos.md), which would muddy the socket baseline.
_CLOSE = {"Connection": "close"}
STOP_TIMEOUT_S = 10.0


class ProcessError(RuntimeError):
    """A process of the run did not start, or died when it should not have."""


async def _open(argv: list[str], out: Path, source: Path | None = None) -> trio.Process:
    """Start `argv` with its output to `out`, in a session (a process group) of its own;
    with `source`, its `edge` package is the one in that checkout (its working directory
    and first on PYTHONPATH: an A/B run)."""
    env = None
    if source is not None:
        env = {**os.environ, "PYTHONPATH": str(source)}
    with out.open("ab") as sink:
        return await trio.lowlevel.open_process(
            argv, stdout=sink, stderr=sink, env=env, cwd=source, start_new_session=True
        )


async def stop_process(process: trio.Process | None, sig: int = signal.SIGTERM) -> int | None:
    """Signal `process`, wait up to STOP_TIMEOUT_S, then kill its process group; then what
    it left in its group is killed. Returns its exit code."""
    if process is None or process.returncode is not None:
        return None if process is None else process.returncode
    with trio.CancelScope(shield=True):
        process.send_signal(sig)
        with trio.move_on_after(STOP_TIMEOUT_S):
            await process.wait()
        if process.returncode is None:
            kill_group(process.pid)
            process.kill()
            with trio.move_on_after(STOP_TIMEOUT_S):
                await process.wait()
        kill_left(process.pid)
    return process.returncode


@dataclass
class SimNode:
    """One simulated node; each incarnation (start or restart) has its own runs log."""

    name: str
    workdir: Path
    port: int = 0
    process: trio.Process | None = None
    runs_logs: list[Path] = field(default_factory=list)
    # (killed at, serving again at), on the run's clock.
    downtimes: list[tuple[float, float]] = field(default_factory=list)
    # When each incarnation was seen listening, wall clock (the runs log's clock).
    listening_at: list[float] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Start an incarnation: on an ephemeral port first, on the same port after that."""
        n = len(self.runs_logs)
        runs_log = self.workdir / f"{self.name}.{n}.runs.jsonl"
        out = self.workdir / f"{self.name}.{n}.out"
        argv = [
            sys.executable,
            "-m",
            "edge.nodes.sim",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--runs-log",
            str(runs_log),
            "--name",
            self.name,
        ]
        self.runs_logs.append(runs_log)
        self.process = await _open(argv, out)
        try:
            with trio.move_on_after(START_TIMEOUT_S):
                while True:
                    text = out.read_text(errors="replace") if out.exists() else ""
                    if "listening on" in text:
                        port = text.split("listening on", 1)[1].split()[0]
                        self.port = int(port.rsplit(":", 1)[1])
                        self.listening_at.append(time.time())
                        return
                    if self.process.returncode is not None or self.process.poll() is not None:
                        break
                    await trio.sleep(0.02)
        except BaseException:  # cancelled while it started: it does not outlive the run
            await stop_process(self.process, signal.SIGKILL)
            raise
        await stop_process(self.process, signal.SIGKILL)
        raise ProcessError(f"{self.name} did not start on port {self.port}: {out.read_text()!r}")

    async def kill(self) -> None:
        """kill -9: runs in flight and runs-log lines not yet written are lost."""
        await stop_process(self.process, signal.SIGKILL)
        self.process = None

    async def stop(self) -> None:
        await stop_process(self.process)
        self.process = None


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a live process has used so far; 0 once it is gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The chaos scenarios' [timeouts]; `None` (the hostile mix) keeps the edge's defaults.
CHAOS_TIMEOUTS = {"first_event_s": FIRST_EVENT_S, "idle_s": IDLE_S, "total_s": TOTAL_S}


def edge_config(
    port: int,
    nodes: list[SimNode],
    *,
    api_keys: tuple[str, ...] = (),
    timeouts: dict[str, float] | None = CHAOS_TIMEOUTS,
    extra: str = "",
    migrations: int | None = None,
) -> str:
    """The edge's config.toml; `extra` is appended as it is (more tables). `migrations`:
    the edge's `[routing] migrations` (None: not written, the edge's default)."""
    lines = [
        "[server]",
        f'listen = "127.0.0.1:{port}"',
        "drain_timeout_s = 2",
        f"keepalive_s = {KEEPALIVE_S}",
    ]
    if api_keys:
        lines.append(f"api_keys = {json.dumps(list(api_keys))}")
    lines += ["", "[log]", 'level = "INFO"', 'format = "json"']
    if timeouts:
        lines += ["", "[timeouts]", *(f"{k} = {v}" for k, v in timeouts.items())]
    if migrations is not None:
        lines += ["", "[routing]", f"migrations = {migrations}"]
    for node in nodes:
        lines += ["", "[[nodes]]", f'name = "{node.name}"', f'address = "{node.address}"']
    return "\n".join(lines) + "\n" + extra


@dataclass
class EdgeProcess:
    """The edge under test, with its JSON log (INFO: one line per finished request)."""

    workdir: Path
    port: int = 0
    process: trio.Process | None = None
    log: Path = field(init=False)
    api_keys: tuple[str, ...] = ()
    timeouts: dict[str, float] | None = field(default_factory=lambda: dict(CHAOS_TIMEOUTS))
    # More config tables, appended to the generated config.toml.
    extra_config: str = ""
    # A checkout whose edge runs instead of this tree's (an A/B run); None: this tree's.
    source: Path | None = None
    # `[routing] migrations`; None: not written (the edge's default).
    migrations: int | None = None

    def __post_init__(self) -> None:
        self.log = self.workdir / "edge.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, nodes: list[SimNode], attempts: int = 3) -> None:
        """Start on a free port (another, if that one was taken meanwhile); wait for /readyz."""
        for _ in range(attempts):
            self.port = free_port()
            config = self.workdir / "edge.toml"
            config.write_text(
                edge_config(
                    self.port,
                    nodes,
                    api_keys=self.api_keys,
                    timeouts=self.timeouts,
                    extra=self.extra_config,
                    migrations=self.migrations,
                )
            )
            argv = [sys.executable, "-m", "edge", "--config", str(config)]
            self.process = await _open(argv, self.log, self.source)
            try:
                if await self._ready():
                    return
            except BaseException:  # cancelled while it started: it does not outlive the run
                await stop_process(self.process, signal.SIGKILL)
                raise
            await stop_process(self.process, signal.SIGKILL)
        raise ProcessError(f"the edge did not become ready; see {self.log}")

    async def _ready(self) -> bool:
        assert self.process is not None
        async with httpx.AsyncClient(base_url=self.url, timeout=2, headers=_CLOSE) as client:
            with trio.move_on_after(START_TIMEOUT_S):
                while self.process.poll() is None:
                    try:
                        if (await client.get("/readyz")).status_code == 200:
                            return True
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(0.05)
        return False

    async def get(self, path: str) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.url, timeout=5, headers=_CLOSE) as client:
            return await client.get(path)

    async def metrics(self) -> dict[str, float]:
        """The Prometheus exposition as {"name{labels}": value} (samples only)."""
        text = (await self.get("/metrics")).text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    async def in_flight(self) -> int:
        nodes: list[dict[str, Any]] = (await self.get("/readyz")).json().get("nodes", [])
        return sum(int(n.get("in_flight", 0)) for n in nodes)

    def cpu_seconds(self) -> float:
        assert self.process is not None
        return cpu_seconds(self.process.pid)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def rss(self) -> int:
        """The edge's resident memory in bytes now (0 once it is gone)."""
        if self.process is None:
            return 0
        try:
            return int(psutil.Process(self.process.pid).memory_info().rss)
        except psutil.Error:
            return 0

    def log_tail(self, lines: int = 40) -> str:
        """The end of the edge's output: the last `lines` lines of its uncaught traceback (a
        raw one, not a log line) when there is one, where the exception itself is; else the
        last `lines` lines."""
        if not self.log.exists():
            return ""
        text = self.log.read_text(errors="replace").splitlines()
        raw = (i for i, line in enumerate(text) if "Traceback" in line and line[:1] != "{")
        first = next(raw, 0)
        return "\n".join(text[first:][-lines:])

    def stats(self) -> Stats:
        assert self.process is not None
        proc = psutil.Process(self.process.pid)
        conns = proc.net_connections(kind="tcp")
        http = [c for c in conns if c.laddr and c.laddr.port == self.port]
        open_peers = tuple(c.raddr.port for c in http if c.raddr and c.status != psutil.CONN_LISTEN)
        return Stats(
            fds=proc.num_fds(),
            threads=proc.num_threads(),
            rss=proc.memory_info().rss,
            http_conns=sum(1 for c in http if c.status != psutil.CONN_LISTEN),
            close_wait=sum(1 for c in conns if c.status == psutil.CONN_CLOSE_WAIT),
            open_peers=open_peers,
        )

    def records(self) -> list[dict[str, Any]]:
        """The edge's JSON log lines (anything else, e.g. a traceback, is skipped)."""
        out: list[dict[str, Any]] = []
        if not self.log.exists():
            return out
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    async def stop(self) -> int | None:
        code = await stop_process(self.process)
        return code


async def probe_healthz(edge: EdgeProcess, out_ms: list[float], errors: list[str]) -> None:
    """GET /healthz every 100 ms from a process of its own (`tests.chaos.probe`), until
    cancelled: the edge's responsiveness under load. Round trips go into `out_ms`; a probe
    that got no 200 (refused, reset, cut) into `errors`. A probe still waiting when this
    is cancelled counts as the time it has waited so far (a frozen edge shows)."""
    argv = [sys.executable, "-m", "tests.chaos.probe", str(edge.port)]
    async with trio.open_nursery() as nursery:
        process = await nursery.start(
            partial(
                trio.run_process,
                argv,
                stdout=subprocess.PIPE,
                check=False,
                start_new_session=True,  # a Ctrl-C is the run's to handle: it kills this
            )
        )
        try:
            assert process.stdout is not None
            pending = b""
            last = trio.current_time()
            async for data in process.stdout:
                last = trio.current_time()
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    seen = json.loads(line)
                    if "ms" in seen:
                        out_ms.append(seen["ms"])
                    else:
                        errors.append(seen["error"])
        finally:
            waited_s = trio.current_time() - last - EVERY_S
            if waited_s > EVERY_S:
                out_ms.append(waited_s * 1000)
            process.kill()


async def healthz(port: int, limit_s: float) -> str:
    """One GET /healthz over a fresh connection: "" when it got a 200, else what went wrong
    ("timeout" past `limit_s`)."""
    answer = b""
    try:
        with trio.move_on_after(limit_s) as scope:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            try:
                await stream.send_all(HEALTHZ_REQUEST)
                while data := await stream.receive_some(4096):
                    answer += data
            finally:
                await stream.aclose()
    except (OSError, trio.BrokenResourceError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if scope.cancelled_caught:
        return "timeout"
    return "" if answer.startswith(b"HTTP/1.1 200") else f"answer {answer[:40]!r}"


@dataclass(frozen=True, slots=True)
class Stats:
    """The edge process's resources at one moment."""

    fds: int
    threads: int
    rss: int
    http_conns: int  # client connections on the HTTP port, in any state
    close_wait: int  # sockets the peer closed and the edge did not
    open_peers: tuple[int, ...] = ()  # client ports of the HTTP connections still open

    def show(self) -> str:
        return (
            f"fds={self.fds} threads={self.threads} rss={self.rss / 2**20:.1f}MiB "
            f"http_conns={self.http_conns} close_wait={self.close_wait}"
        )
