"""The garbage collector's pauses, timed: `watch_gc` hears each collection's length.

CPython runs a collection on whichever thread allocates past a threshold; on
the edge that is mostly the event loop's, and the whole process waits for it.
`gc.callbacks` tells the start and the end of each collection; the time
between them goes to `observe` (generation, seconds), from the thread that
collected. A callback costs a clock read and an observation per collection.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any


def watch_gc(observe: Callable[[int, float], None]) -> Callable[[], None]:
    """Time every collection from now on; returns what stops it."""
    started = 0.0

    def callback(phase: str, info: dict[str, Any]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            observe(int(info["generation"]), time.perf_counter() - started)

    gc.callbacks.append(callback)

    def stop() -> None:
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)

    return stop
