"""`iop-edge` and `iop-sim-node` as real subprocesses, for operability tests.

`edge_process(...)` writes a config.toml, starts the `iop-edge` console
script on an ephemeral port, collects its stderr lines in a thread, waits
until it serves (its "serving on" line, then GET /healthz), and kills it in
`finally` whatever the test did. Every wait is bounded. `pause_reading`
makes its stderr a pipe nobody reads (until `resume_reading`).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

STARTUP_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 15.0
_SERVING = re.compile(r"serving on (http://\S+)")


def _script(name: str) -> list[str]:
    """The installed console script, or `python -m` when it is not installed."""
    path = Path(sys.executable).parent / name
    if path.exists():
        return [str(path)]
    return [sys.executable, "-m", {"iop-edge": "edge", "iop-sim-node": "edge.nodes.sim"}[name]]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@dataclass
class EdgeProcess:
    """A running `iop-edge`: its process, URL and every stderr line so far."""

    process: subprocess.Popen[str]
    url: str = ""
    lines: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None
    _reading_allowed: threading.Event = field(default_factory=threading.Event)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def json_lines(self) -> list[dict[str, Any]]:
        """Every stderr line parsed as JSON (fails on any line that is not)."""
        return [json.loads(line) for line in self.lines if line.strip()]

    def pause_reading(self) -> None:
        """Stop reading stderr (after the line being read): the pipe fills, then the edge's
        writes to it block."""
        self._reading_allowed.clear()

    def resume_reading(self) -> None:
        self._reading_allowed.set()

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.process.send_signal(signum)

    async def wait_line(self, pattern: str, within_s: float = STARTUP_TIMEOUT_S) -> str:
        """The first stderr line matching `pattern`, once the process has written it."""
        regex = re.compile(pattern)
        with trio.fail_after(within_s):
            while True:
                for line in list(self.lines):
                    if regex.search(line):
                        return line
                if self.process.poll() is not None and not self._reading():
                    raise AssertionError(f"iop-edge exited before {pattern!r}:\n{self.stderr}")
                await trio.sleep(0.02)  # another process's output: poll, bounded

    async def wait_exit(self, within_s: float = EXIT_TIMEOUT_S) -> int:
        """The exit code, once the process has ended (and its stderr was read to the end)."""
        code = await trio.to_thread.run_sync(self.process.wait, within_s)
        if self._reader is not None:
            await trio.to_thread.run_sync(self._reader.join, within_s)
        return code

    def _reading(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            self._reading_allowed.wait()


def kill(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    try:
        process.wait(10)
    finally:
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


def _spawn(
    argv: list[str], env: dict[str, str], fd_limit: int | None = None
) -> subprocess.Popen[str]:
    """Start a process whose stderr we read (Popen returns at once; it does not wait).

    `fd_limit` sets both the soft and the hard RLIMIT_NOFILE of the child (the
    edge raises its soft limit to the hard one, so only a hard limit sticks).
    """

    def limit_fds() -> None:
        assert fd_limit is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=None if fd_limit is None else limit_fds,
    )


@asynccontextmanager
async def edge_process(
    tmp: Path,
    config_toml: str,
    *,
    log_format: str = "text",
    env: Mapping[str, str] | None = None,
    name: str = "edge",
    fd_limit: int | None = None,
) -> AsyncIterator[EdgeProcess]:
    """`iop-edge --config <tmp>/<name>.toml --log-format FMT`, serving, killed on exit.

    `fd_limit`: the child's file-descriptor limit, soft and hard (default: inherited).
    The edge's temporary folders (its run's, its response store's) go in a folder of
    its own, removed after it (TMPDIR, unless `env` names one): killed, the edge cannot
    remove them itself. A short path in the system's temporary folder, as the edge's
    own would be: a Unix socket's path is bounded (108 bytes).
    """
    config = tmp / f"{name}.toml"
    config.write_text(config_toml)
    scratch = tempfile.mkdtemp(prefix="iop-test-")
    try:
        process = _spawn(
            [*_script("iop-edge"), "--config", str(config), "--log-format", log_format],
            {**os.environ, "TMPDIR": scratch, **(env or {})},
            fd_limit,
        )
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    edge = EdgeProcess(process)
    edge.resume_reading()
    edge._reader = threading.Thread(target=edge._read, daemon=True)
    edge._reader.start()
    try:
        line = await edge.wait_line(_SERVING.pattern)
        match = _SERVING.search(line)
        assert match is not None
        edge.url = match.group(1).rstrip('",}')
        async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
            assert (await client.get("/healthz")).status_code == 200
        yield edge
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        edge.resume_reading()
        edge._reader.join(10)  # EOF once the process is gone; then the pipe can close
        assert process.stderr is not None
        process.stderr.close()
        shutil.rmtree(scratch, ignore_errors=True)


def start_sim_on(port: int, runs_log: Path, *args: str) -> subprocess.Popen[str]:
    """`iop-sim-node` on a fixed 127.0.0.1 port (`args` added to its command); returns
    once it listens."""
    process = subprocess.Popen(
        [
            *_script("iop-sim-node"),
            "--listen",
            f"127.0.0.1:{port}",
            "--runs-log",
            str(runs_log),
            *args,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    line = process.stdout.readline()  # the first line is "listening on", or EOF on failure
    if "listening on" not in line:
        kill(process)
        raise RuntimeError(f"iop-sim-node did not start on port {port}: {line!r}")
    return process
