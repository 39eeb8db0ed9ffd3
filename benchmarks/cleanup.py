"""What a bench or chaos program starts ends with it, however the program is stopped.

`make bench`, `make chaos` and `make hostile` start edges, simulated nodes, iop-node,
peer gateways and load generators, and work in temporary directories. `make` passes a
SIGTERM on to its own child only, and a SIGINT comes from a terminal or a script:
neither may leave a process running or a directory behind.

- `run_program(main, name)` runs a program's `main` with SIGTERM and SIGINT turned into
  KeyboardInterrupt (the first one: a second does not cut the cleanup short), so every
  `finally` and context manager runs; then `sweep` stops whatever still runs under the
  program and, when a signal stopped it, the directories of `temp_dir` still there are
  removed. The program is the subreaper of what its children leave (Linux): a
  grandchild whose parent died is found too. Returns main's status, or 128 + the signal.
- `run_trio(fn, *args)`: `trio.run`, which the signal cancels instead; the `finally`
  blocks then run cancelled (shield what must await), and KeyboardInterrupt follows.
- `child_options()`: Popen keywords for a child: a session (so a process group) of its
  own, and, started from the main thread on Linux, SIGTERM when the program dies, even
  by SIGKILL (PR_SET_PDEATHSIG). `trio.lowlevel.open_process` starts a child from a
  worker thread, whose end would be its parent's death: pass `start_new_session` alone.
- `stop(proc)`: a signal to the child, a bounded wait, then SIGKILL to its group (what
  it left in its group too: `kill_left`).

Knows nothing of what the processes are; imports nothing of benchmarks.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import psutil  # type: ignore[import-untyped]

STOP_WAIT_S = 10.0
KILL_WAIT_S = 5.0
# prctl(2) options (linux/prctl.h).
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None

T = TypeVar("T")


@dataclass
class _Stop:
    """The program's stop: the signal that asked for it, and how it is delivered."""

    signalled: int | None = None
    # Raise KeyboardInterrupt on the first signal: on while `main` runs outside trio.
    raising: bool = False
    # Set while a trio run is on: the signal cancels it instead.
    cancel: Callable[[], None] | None = None
    # The temporary directories to remove at the end.
    dirs: set[Path] = field(default_factory=set)


_stop = _Stop()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _stop.signalled is not None:
        return
    _stop.signalled = signum
    if _stop.cancel is not None:
        _stop.cancel()
    elif _stop.raising:
        raise KeyboardInterrupt


def _prctl(option: int, value: int) -> bool:
    if _libc is None:
        return False
    zero = ctypes.c_ulong(0)
    return bool(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), zero, zero, zero) == 0)


def _die_with(parent: int) -> None:
    """In the child, before it runs its program: SIGTERM when `parent` dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def die_with_parent() -> None:
    """This process ends (SIGTERM) when the one that started it dies (Linux)."""
    _die_with(os.getppid())


def child_options() -> dict[str, Any]:
    """Keywords for `subprocess.Popen`: a session of its own, and the child's end with
    this program. The parent of PR_SET_PDEATHSIG is the starting thread, so only a
    child started from the main thread gets it."""
    options: dict[str, Any] = {"start_new_session": True}
    if _libc is not None and threading.current_thread() is threading.main_thread():
        options["preexec_fn"] = partial(_die_with, os.getpid())
    return options


def kill_group(pid: int) -> None:
    """SIGKILL to the process group of `pid`: a child started in a session of its own,
    not waited for yet (so its pid, and the group's id, are still its own)."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def kill_left(pgid: int) -> None:
    """SIGKILL to what is left under this program of the process group `pgid`, whose
    leader is gone: the id may be another's by now, so nothing else is touched."""
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid:
                proc.kill()


def stop(
    proc: subprocess.Popen[Any] | None, sig: int = signal.SIGTERM, wait_s: float = STOP_WAIT_S
) -> int | None:
    """`sig` to `proc`, up to `wait_s` for it to exit, then SIGKILL to its group; then
    what it left in its group is killed. Returns its exit status."""
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(KILL_WAIT_S)
    kill_left(proc.pid)
    return proc.returncode


def temp_dir(prefix: str, keep: bool = False) -> Path:
    """A new temporary directory. Unless `keep`, a program stopped by a signal removes
    it on its way out (`run_program`), unless it was removed or kept by then."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if not keep:
        _stop.dirs.add(path)
    return path


def keep_dir(path: Path) -> None:
    """Leave `path` in place, even if a signal comes now (its logs are wanted)."""
    _stop.dirs.discard(path)


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _stop.dirs.discard(path)


def _spared() -> set[int]:
    """multiprocessing's resource tracker: it ignores SIGTERM and SIGINT, and ends by
    itself when this program does (its pipe closes)."""
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    pid = getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)
    return {pid} if isinstance(pid, int) else set()


def _under_me() -> list[psutil.Process]:
    spared = _spared()
    out = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.pid not in spared and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
    return out


def sweep(wait_s: float = STOP_WAIT_S) -> list[int]:
    """Stop every process still running under this one: SIGTERM, up to `wait_s` for
    them to exit, then SIGKILL. Returns their pids (none, when the program's own
    cleanup did its work)."""
    found = _under_me()
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(found, timeout=wait_s)
    for proc in alive + _under_me():
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=KILL_WAIT_S)
    return [proc.pid for proc in found]


def _install() -> None:
    signals = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signals.append(signal.SIGINT)  # ignored (a script's background job): it stays so
    for sig in signals:
        signal.signal(sig, _on_signal)


def run_program(main: Callable[[], int], name: str) -> int:
    """Run `main` so that a SIGTERM or SIGINT stops it cleanly (see the module's text);
    `name` prefixes what is printed. Returns the program's exit status."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _install()
    _stop.raising = True
    try:
        return main()
    except KeyboardInterrupt:
        signum = _stop.signalled or signal.SIGINT
        print(f"{name}: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        _stop.raising = False
        left = sweep()
        if left:
            print(f"{name}: stopped processes left running: {left}", file=sys.stderr)
        if _stop.signalled is not None:
            for path in list(_stop.dirs):
                remove_dir(path)


def run_trio(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`trio.run(fn, *args)`; under `run_program`, a SIGTERM or SIGINT cancels the run,
    and raises KeyboardInterrupt once `fn` has unwound (never inside trio's loop)."""
    import trio

    async def cancellable() -> list[T]:
        token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            _stop.cancel = partial(token.run_sync_soon, scope.cancel)
            if _stop.signalled is not None:
                scope.cancel()
            try:
                return [await fn(*args)]
            finally:
                _stop.cancel = None
        return []

    raising, _stop.raising = _stop.raising, False
    try:
        result = trio.run(cancellable)
    finally:
        _stop.raising = raising
    if _stop.signalled is not None or not result:
        raise KeyboardInterrupt
    return result[0]
