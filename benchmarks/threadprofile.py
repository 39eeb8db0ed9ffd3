"""cProfile on every thread of a program: `python -P threadprofile.py OUT -m MODULE ARGS...`.

`python -m cProfile` counts the main thread's calls only, and the edge parses and
prepares each request in a worker thread (`trio.to_thread`). Here the main thread is
profiled from the start, and every thread started later through `threading` gets a
profiler of its own as it starts (`threading.setprofile`). When MODULE's main returns
or exits, the main thread's stats are written to OUT and the other threads', merged, to
OUT.threads (both in cProfile's format, for `pstats`); MODULE's exit status is kept.
A thread's calls still on its stack then (an idle worker's wait) are not counted.

Run as a script by its path, also by another revision's venv: imports the standard
library only.
"""

from __future__ import annotations

import cProfile
import pstats
import runpy
import sys
import threading
from types import FrameType
from typing import Any

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()


class _Snapshot:
    """A thread's stats as `pstats.Stats` takes them, without disabling its profiler
    (which `create_stats` would do on the calling thread, not on the profiled one)."""

    def __init__(self, profile: cProfile.Profile) -> None:
        profile.snapshot_stats()
        self.stats = profile.stats

    def create_stats(self) -> None:
        pass


def _start(frame: FrameType, event: str, arg: Any) -> None:
    """A new thread's first profile event: from here on, a profiler of its own."""
    profile = cProfile.Profile()
    with _lock:
        _profiles.append(profile)
    profile.enable()


def _write(main: cProfile.Profile, out: str) -> None:
    main.disable()
    main.dump_stats(out)
    threads = pstats.Stats()
    with _lock:
        for profile in _profiles:
            threads.add(_Snapshot(profile))  # type: ignore[arg-type]
    threads.dump_stats(out + ".threads")


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit("usage: threadprofile.py OUT -m MODULE [ARGS...]")
    out, module = sys.argv[1], sys.argv[3]
    sys.argv[:] = [module, *sys.argv[4:]]
    threading.setprofile(_start)
    profile = cProfile.Profile()
    profile.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        threading.setprofile(None)
        _write(profile, out)


if __name__ == "__main__":
    main()
