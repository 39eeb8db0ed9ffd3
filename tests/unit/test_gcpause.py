"""The garbage collector's pauses are timed, by generation, until the watch stops."""

from __future__ import annotations

import gc

from edge.observe.gcpause import watch_gc


def test_each_collection_is_timed_until_the_watch_stops() -> None:
    seen: list[tuple[int, float]] = []
    stop = watch_gc(lambda generation, seconds: seen.append((generation, seconds)))
    try:
        gc.collect()
        gc.collect(0)
    finally:
        stop()
    assert (2, seen[0][1]) == seen[0]
    assert any(generation == 0 for generation, _ in seen[1:])
    assert all(seconds >= 0 for _, seconds in seen)
    taken = len(seen)
    gc.collect()
    assert len(seen) == taken  # stopped
    stop()  # twice: a no-op
