"""The garbage collector's pauses, timed: `GcPauses` hears each collection's length.

CPython runs a collection on whichever thread allocates past a threshold; on
the edge that is mostly the event loop's, and the whole process waits for it.
`gc.callbacks` tells the start and the end of each collection. A collection
can start anywhere, inside code that holds a lock (prometheus-client's, while
it makes a series), so the callback takes none: it appends (generation,
seconds) to a bounded deque, and the loop hands them to the histogram when it
is safe (`drain`, from `EdgeMetrics.sync` and a scrape). A callback costs a
clock read and an append per collection.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# Pauses kept until drained: a worker drains them every second or so.
KEPT = 4096


class GcPauses:
    """Each collection's pause, from the moment `start` is called until `stop`."""

    __slots__ = ("_callback", "_pending")

    def __init__(self) -> None:
        self._pending: deque[tuple[int, float]] = deque(maxlen=KEPT)
        self._callback: Callable[[str, dict[str, Any]], None] | None = None

    def start(self) -> None:
        """Time every collection from now on (once)."""
        if self._callback is not None:
            return
        pending = self._pending
        started = 0.0

        def callback(phase: str, info: dict[str, Any]) -> None:
            nonlocal started
            if phase == "start":
                started = time.perf_counter()
            else:
                pending.append((info["generation"], time.perf_counter() - started))

        self._callback = callback
        gc.callbacks.append(callback)

    def stop(self) -> None:
        """Time no more collections (idempotent)."""
        callback, self._callback = self._callback, None
        if callback is not None and callback in gc.callbacks:
            gc.callbacks.remove(callback)

    def drain(self, observe: Callable[[int, float], None]) -> None:
        """Hand each pause timed since the last drain to `observe` (generation, seconds)."""
        pending = self._pending
        while pending:
            observe(*pending.popleft())
