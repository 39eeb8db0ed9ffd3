"""A stopped `make bench` (its main run, `--calls`) or `make chaos` leaves no process and
no directory behind.

`make` passes a SIGTERM on to the program it runs, and a terminal or a script sends
SIGINT. Either way the program stops every process it started (the edge, the simulated
nodes, the load generators and what they started) and removes its temporary directories
before it exits with 128 + the signal (`benchmarks.cleanup`).

Each test starts the program in a session of its own, with TMPDIR a fresh directory,
waits until it runs an edge and a simulated node (and its load generator, or the chaos
run's /healthz probe: the load is on), notes every process under it, signals it, and
checks: every noted process has exited (awaited on a pidfd each), no process is left in
the program's session or in those of its children, and TMPDIR is empty.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START_S = 60.0  # until the edge and a node run (a loaded 2-core machine)
STOP_S = 60.0  # until the program and everything it started are gone

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc (Linux)")

Tree = dict[int, str]  # pid -> command line


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with suppress(OSError):
                out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _cmdline(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()).strip()
    except OSError:
        return ""


def _tree(pid: int) -> Tree:
    """Every process under `pid` (its children, theirs, and so on) and its command line."""
    tree: Tree = {}
    todo = _children(pid)
    while todo:
        child = todo.pop()
        if child not in tree:
            tree[child] = _cmdline(child)
            todo += _children(child)
    return tree


def _ticks() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat gives a start time in."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _in_sessions(sessions: set[int], born_by: int) -> Tree:
    """The live processes (not zombies) whose session is one of `sessions`, started by
    `born_by` (ticks): a session's id is its first process's pid, which another process
    may have by now, and whose session would start later."""
    out: Tree = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp session ... starttime ...": comm may hold spaces and
        # parentheses; starttime is the 22nd field.
        fields = stat.rsplit(")", 1)[1].split()
        state, session, started = fields[0], int(fields[3]), int(fields[19])
        if session in sessions and state not in ("Z", "X") and started <= born_by:
            out[int(entry.name)] = _cmdline(int(entry.name))
    return out


def _pidfds(tree: Tree) -> dict[int, int]:
    """A pidfd for each process of `tree` still there: it reads ready once it exits."""
    fds: dict[int, int] = {}
    for pid in tree:
        with suppress(ProcessLookupError):
            fds[os.pidfd_open(pid)] = pid
    return fds


def _wait_gone(fds: dict[int, int], timeout_s: float) -> Tree:
    """Wait (bounded) until every pidfd reads ready; the processes still running."""
    poll = select.poll()
    for fd in fds:
        poll.register(fd, select.POLLIN)
    left = dict(fds)
    deadline = time.monotonic() + timeout_s
    while left and (wait_s := deadline - time.monotonic()) > 0:
        for fd, _ in poll.poll(wait_s * 1000):
            poll.unregister(fd)
            left.pop(fd, None)
    for fd in fds:
        os.close(fd)
    return {pid: _cmdline(pid) for pid in left.values()}


@dataclass
class Program:
    """The program under test, and the processes noted under it."""

    proc: subprocess.Popen[bytes]
    noted: Tree = field(default_factory=dict)
    noted_at: int = 0  # ticks (`_ticks`)

    def note(self) -> Tree:
        """The processes under the program now (also kept, for the cleanup)."""
        tree = _tree(self.proc.pid)
        self.noted.update(tree)
        self.noted_at = _ticks()
        return tree


@contextmanager
def _program(argv: list[str], tmp: Path) -> Iterator[Program]:
    """`python argv` from the repository, in a session of its own, TMPDIR=`tmp`; whatever
    the test's outcome, nothing of it runs after (what the program leaves is killed)."""
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    program = Program(proc)
    try:
        yield program
    finally:
        if proc.poll() is None:
            program.note()
            proc.terminate()
            try:
                proc.communicate(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        for pid in _in_sessions({proc.pid, *program.noted}, program.noted_at):
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _read_until(proc: subprocess.Popen[bytes], text: str, timeout_s: float) -> list[str]:
    """The program's stderr lines up to the first holding `text` (bounded)."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    lines: list[str] = []
    pending = b""
    deadline = time.monotonic() + timeout_s
    while (wait_s := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], wait_s)[0]:
            continue
        data = os.read(fd, 1 << 16)
        assert data, f"the program exited before {text!r}:\n" + "\n".join(lines)
        *whole, pending = (pending + data).split(b"\n")
        lines += [line.decode(errors="replace") for line in whole]
        if any(text in line for line in lines):
            return lines
    raise AssertionError(f"no {text!r} within {timeout_s:.0f} s:\n" + "\n".join(lines))


def _wait_tree(program: Program, ready: Callable[[Tree], bool], timeout_s: float) -> Tree:
    """The processes under the program, once `ready` says they are what the test needs."""
    proc = program.proc
    deadline = time.monotonic() + timeout_s
    while True:
        tree = program.note()
        if ready(tree):
            return tree
        assert proc.poll() is None, f"the program exited early ({proc.returncode}): {tree}"
        assert time.monotonic() < deadline, f"not ready within {timeout_s:.0f} s: {tree}"
        time.sleep(0.05)  # another process's children: nothing to wait on but /proc


def _stop_and_check(program: Program, tree: Tree, sig: int, tmp: Path) -> None:
    """Signal the program; then nothing it started runs and its directories are gone."""
    proc = program.proc
    fds = _pidfds(tree)
    signalled_at = _ticks()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the program did not exit within {STOP_S:.0f} s of {sig!r}")
    said = err.decode(errors="replace")[-2000:]
    running = _wait_gone(fds, STOP_S)
    assert not running, f"still running: {running}\n{said}"
    left = _in_sessions({proc.pid, *tree}, signalled_at)
    assert not left, f"left in the program's sessions: {left}\n{said}"
    assert not list(tmp.iterdir()), f"left in TMPDIR: {list(tmp.iterdir())}\n{said}"
    assert proc.returncode == 128 + sig, said


def _has(tree: Tree, *words: str) -> bool:
    return all(any(word in cmd for cmd in tree.values()) for word in words)


def test_a_bench_run_stopped_by_sigterm_stops_what_it_started(tmp_path: Path) -> None:
    """SIGTERM (what `make` passes on when it is stopped) to `python -m benchmarks` once
    its edge, simulated node and load generator run: all of them exit, and the run's
    temporary directory is removed."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "latest.json"
    argv = ["-m", "benchmarks", "--quick", "--clients", "1", "--open-streams", "10"]
    with _program([*argv, "--out", str(out)], tmp) as program:
        # Logged once the stack is ready and the load-generator processes are started.
        _read_until(program.proc, "clients [", START_S)
        tree = program.note()
        assert _has(tree, "iop-edge", "iop-sim-node", "multiprocessing"), tree
        _stop_and_check(program, tree, signal.SIGTERM, tmp)
    assert not out.exists()


def test_a_chaos_run_stopped_by_sigint_stops_what_it_started(tmp_path: Path) -> None:
    """SIGINT to `python -m tests.chaos` while its load is on (the edge, a simulated node
    and the /healthz probe run, streams in flight): all of them exit, and the run's work
    directory is removed."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = ["-m", "tests.chaos", "--seed", "5", "--streams", "40", "--nodes", "1"]
    argv += ["--node-kills", "0", "--idle-close", "0", "--rate", "5"]
    with _program(argv, tmp) as program:
        tree = _wait_tree(
            program, lambda t: _has(t, "edge.nodes.sim", "tests.chaos.probe"), START_S
        )
        assert _has(tree, "-m edge --config"), tree
        _stop_and_check(program, tree, signal.SIGINT, tmp)


def test_a_call_count_run_stopped_by_sigterm_stops_what_it_started(tmp_path: Path) -> None:
    """SIGTERM to `python -m benchmarks --calls` once its edge runs under the profiler
    (`benchmarks/threadprofile.py`) beside its simulated node: both exit, and the run's
    temporary directory (where a stopped edge writes its profile) is removed."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = ["-m", "benchmarks", "--calls", "--calls-requests", "100000,100001"]
    argv += ["--calls-workloads", "nonstream", "--out", str(tmp_path / "calls.json")]
    with _program(argv, tmp) as program:
        # Logged before the run's stack starts.
        _read_until(program.proc, "calls: non-stream request", START_S)
        tree = _wait_tree(program, lambda t: _has(t, "threadprofile", "iop-sim-node"), START_S)
        _stop_and_check(program, tree, signal.SIGTERM, tmp)
    assert not (tmp_path / "calls.json").exists()
