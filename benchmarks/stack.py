"""The processes under test: `iop-sim-node` and `iop-edge` on 127.0.0.1, and their probes.

`Stack` starts the simulated node (its runs log is a FIFO read by a thread that stamps
every line with the system-wide monotonic clock, so the time a CancelRun reached the
node is known per run) and the edge (a temporary config.toml), waits until the edge
answers /readyz, and stops both however the run ends (`benchmarks.cleanup.stop`: SIGTERM,
then SIGKILL to the process group).
`Probe` reads one process's CPU time and RSS with psutil; `cpu_s` reads a process's
CPU to the nanosecond (Linux), `up_nodes` how many nodes an edge has up; `cores_apart`
puts some processes on a CPU of their own for a while (Linux: `can_set_apart`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]

from benchmarks.cleanup import child_options, stop

STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
mono = time.monotonic


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def venv_script(name: str) -> str:
    """A console script installed beside this interpreter (the project's .venv)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise SystemExit(f"benchmarks: {path} is missing; run `make setup` first")
    return str(path)


class Probe:
    """CPU seconds (user + system, all threads) and RSS of one process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._proc = psutil.Process(pid)

    def cpu(self) -> float:
        try:
            times = self._proc.cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return float(times.user + times.system)

    def cpu_sys(self) -> float:
        """System (kernel) CPU seconds only."""
        try:
            return float(self._proc.cpu_times().system)
        except psutil.NoSuchProcess:
            return 0.0

    def rss(self) -> int:
        try:
            return int(self._proc.memory_info().rss)
        except psutil.NoSuchProcess:
            return 0


@dataclass
class RunsLog:
    """The simulated node's runs log, read from a FIFO: run_id -> (arrival time, record)."""

    path: Path
    runs: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    unknown_cancels: int = 0
    _fd: int = -1
    _thread: threading.Thread | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def open(self) -> None:
        os.mkfifo(self.path)
        # Open the read end first (non-blocking), so the node's open for append succeeds.
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(self._fd, True)
        self._thread = threading.Thread(target=self._read, name="runs-log", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        pending = b""
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except OSError:
                return
            now = mono()
            if not data:
                # No writer yet (or the node exited): wait a little, bounded by the node's life.
                time.sleep(0.01)
                if self._fd < 0:
                    return
                continue
            lines = (pending + data).split(b"\n")
            pending = lines.pop()
            with self._cond:
                for line in lines:
                    if not line:
                        continue
                    record = json.loads(line)
                    if record.get("type") == "cancel_rpc":
                        self.unknown_cancels += 1
                    elif "run_id" in record:
                        self.runs[record["run_id"]] = (now, record)
                self._cond.notify_all()

    def wait_for(self, run_ids: set[str], timeout_s: float) -> int:
        """Wait until every id in `run_ids` has its line (bounded); returns how many have."""
        deadline = mono() + timeout_s
        with self._cond:
            while True:
                have = sum(1 for r in run_ids if r in self.runs)
                left = deadline - mono()
                if have == len(run_ids) or left <= 0:
                    return have
                self._cond.wait(min(left, 0.05))

    def get(self, run_id: str) -> tuple[float, dict[str, Any]] | None:
        with self._cond:
            return self.runs.get(run_id)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def node_active_runs(port: int, timeout_s: float = 2.0) -> int | None:
    """The node's live runs, by its Describe RPC (None when it does not answer in time)."""
    from grpclib.client import Channel
    from grpclib.const import Cardinality

    from edge.contract._proto.iop.node import v1 as pb

    async def ask() -> int:
        channel = Channel("127.0.0.1", port)
        try:
            async with channel.request(
                "/iop.node.v1.NodeService/Describe",
                Cardinality.UNARY_UNARY,
                pb.DescribeRequest,
                pb.DescribeResponse,
                timeout=timeout_s,
            ) as stream:
                await stream.send_message(pb.DescribeRequest(), end=True)
                response = await stream.recv_message()
        finally:
            channel.close()
        assert response is not None
        return int(response.active_runs)

    try:
        return asyncio.run(ask())
    except Exception:
        return None


def spawn(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, **kwargs: Any
) -> subprocess.Popen[bytes]:
    """`cmd` with its output to `log`, in a session of its own, ending with this program."""
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            **child_options(),
            **kwargs,
        )


def stop_process(proc: subprocess.Popen[Any] | None) -> None:
    """SIGTERM, then SIGKILL to its process group after STOP_TIMEOUT_S."""
    stop(proc, signal.SIGTERM, STOP_TIMEOUT_S)


def get_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        with exc:  # its connection closed now, not when collected
            return int(exc.code)
    except OSError:
        return 0


EDGE_CONFIG = """\
[server]
listen = "127.0.0.1:{port}"
drain_timeout_s = 2
keepalive_s = 15
node_refresh_s = 0.5

[log]
level = "WARNING"

[timeouts]
first_event_s = 120
idle_s = 900
total_s = 1800

[[nodes]]
name = "{name}"
address = "{node}"
"""


@dataclass(frozen=True)
class EdgeSource:
    """Which code the edge process runs: this tree's (the default) or another revision's.

    `command` replaces the `iop-edge` console script (a revision with its own venv);
    `env` is added to the edge's environment (PYTHONPATH for a revision that shares this
    venv). The node and the load generator always run this tree's code.
    """

    label: str = "tree"
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


class Stack:
    """The simulated node and the edge, as subprocesses; a context manager."""

    def __init__(
        self,
        tmp: Path,
        edge_source: EdgeSource | None = None,
        *,
        node_keys: str = "",
        extra_config: str = "",
        server_keys: str = "",
        node_port: int = 0,
        node_args: tuple[str, ...] = (),
    ) -> None:
        """`node_keys` are TOML lines added to the node's `[[nodes]]` table, `node_args`
        flags added to the simulated node's command (its TLS and token), `extra_config`
        tables added after it (the overload workload's `max_runs` and `[admission]`),
        `server_keys` lines added to `[server]` (the worker count). With `node_port` the
        edge uses the simulated node already listening there (another stack's)."""
        self.tmp = tmp
        self.edge_source = edge_source or EdgeSource()
        self.node_keys = node_keys
        self.extra_config = extra_config
        self.server_keys = server_keys
        self.sim: subprocess.Popen[bytes] | None = None
        self.edge: subprocess.Popen[bytes] | None = None
        self.runs_log = RunsLog(tmp / "runs.fifo")
        self.node_port = node_port
        self.node_args = node_args
        self._own_node = not node_port
        self.edge_port = 0
        self.edge_probe: Probe | None = None
        self.node_probe: Probe | None = None

    def __enter__(self) -> Stack:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        deadline = mono() + STARTUP_TIMEOUT_S
        if self._own_node:
            self._start_node(deadline)
        self._start_edge(deadline)

    def _start_node(self, deadline: float) -> None:
        self.runs_log.open()
        sim_out = self.tmp / "sim.log"
        self.sim = spawn(
            [
                venv_script("iop-sim-node"),
                "--listen",
                "127.0.0.1:0",
                "--runs-log",
                str(self.runs_log.path),
                *self.node_args,
            ],
            sim_out,
        )
        while mono() < deadline:
            text = sim_out.read_text(errors="replace")
            if "listening on" in text:
                self.node_port = int(text.split("listening on", 1)[1].split()[0].rsplit(":", 1)[1])
                break
            if self.sim.poll() is not None:
                raise SystemExit(f"iop-sim-node exited: {text[-500:]}")
            time.sleep(0.05)
        else:
            raise SystemExit("iop-sim-node did not start in time")
        self.node_probe = Probe(self.sim.pid)

    def _start_edge(self, deadline: float) -> None:
        self.edge_port = free_port()
        config = self.tmp / "config.toml"
        text = EDGE_CONFIG.format(
            port=self.edge_port, name="sim", node=f"127.0.0.1:{self.node_port}"
        ).replace("\n\n[log]", f"\n{self.server_keys}\n\n[log]", 1)
        config.write_text(text + self.node_keys + self.extra_config)
        source = self.edge_source
        command = list(source.command) or [venv_script("iop-edge")]
        self.edge = spawn(
            [*command, "--config", str(config), "--log-level", "WARNING"],
            self.tmp / "edge.log",
            env=dict(source.env),
        )
        base = f"http://127.0.0.1:{self.edge_port}"
        while mono() < deadline:
            if self.edge.poll() is not None:
                raise SystemExit(f"iop-edge exited: {self.edge_log()[-800:]}")
            if get_status(base + "/healthz") == 200 and get_status(base + "/readyz") == 200:
                break
            time.sleep(0.1)
        else:
            raise SystemExit(f"iop-edge was not ready in time: {self.edge_log()[-800:]}")
        self.edge_probe = Probe(self.edge.pid)

    def edge_processes(self) -> list[Probe]:
        """The edge's processes: the one process, or the supervisor and its workers."""
        assert self.edge is not None
        children = psutil.Process(self.edge.pid).children()
        return [Probe(self.edge.pid), *(Probe(c.pid) for c in children)]

    def edge_log(self) -> str:
        path = self.tmp / "edge.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        stop_process(self.edge)
        if self._own_node:
            stop_process(self.sim)
            self.runs_log.close()


def cpu_s(pid: int) -> float:
    """The CPU time of every thread of `pid`, in seconds, to the nanosecond where the
    kernel says (Linux), else psutil's ticks."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                total += int((task / "schedstat").read_text().split()[0])
    except OSError:
        return Probe(pid).cpu()
    return total / 1e9


def up_nodes(base: str) -> int:
    """How many nodes the edge has up, from its /metrics (iop_edge_node_state == 1)."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0
    return sum(
        1
        for line in text.splitlines()
        if line.startswith("iop_edge_node_state{") and line.rsplit(" ", 1)[-1] in ("1", "1.0")
    )


def pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of each of `pids` on `cpus` (threads they start later inherit it from
    their creator). Linux; a process gone meanwhile is skipped."""
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task.name), cpus)


def can_set_apart() -> bool:
    """Whether a process can have a CPU of its own here (Linux, two CPUs or more)."""
    return hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2


@contextlib.contextmanager
def cores_apart(apart: list[int], rest: list[int]) -> Iterator[bool]:
    """For the block: the processes `apart` on the machine's last CPU, `rest` on the
    others; then every one of them on all the CPUs again. Yields whether it could (see
    `can_set_apart`; where it cannot, all are left as they are)."""
    if not can_set_apart():
        yield False
        return
    cpus = sorted(os.sched_getaffinity(0))
    pin(rest, set(cpus[:-1]))
    pin(apart, {cpus[-1]})
    try:
        yield True
    finally:
        pin(apart + rest, set(cpus))
