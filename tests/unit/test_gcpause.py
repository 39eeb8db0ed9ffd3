"""The garbage collector's pauses are timed, by generation, without taking a lock."""

from __future__ import annotations

import gc

from edge.observe.gcpause import GcPauses
from edge.observe.metrics import EdgeMetrics


def test_each_collection_is_timed_until_stopped() -> None:
    pauses = GcPauses()
    pauses.start()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        pauses.stop()
    seen: list[tuple[int, float]] = []
    pauses.drain(lambda generation, seconds: seen.append((generation, seconds)))
    assert seen[0][0] == 2
    assert any(generation == 0 for generation, _ in seen[1:])
    assert all(seconds >= 0 for _, seconds in seen)
    gc.collect()
    pauses.drain(lambda generation, seconds: seen.append((generation, seconds)))
    assert len(seen) == 2  # stopped
    pauses.stop()  # twice: a no-op


def test_the_callback_observes_nothing_itself_a_scrape_does() -> None:
    """A collection can start while prometheus-client holds its lock (making a series, in
    a worker): the callback only keeps the pause, and the histogram gets it from the loop,
    on a scrape (or a worker's sync)."""
    metrics = EdgeMetrics()
    metrics.gc_pauses.start()
    try:
        gc.collect()
    finally:
        metrics.gc_pauses.stop()
    count = {"generation": "2"}
    assert metrics.registry.get_sample_value("iop_edge_gc_pause_seconds_count", count) is None
    metrics.render()
    assert metrics.registry.get_sample_value("iop_edge_gc_pause_seconds_count", count) == 1.0
