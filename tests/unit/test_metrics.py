"""Gauges read from functions (`edge.observe.metrics.EdgeMetrics.watch_*`).

A single process reads them when scraped; a worker (a multiprocess directory)
writes them at each `sync`, since another worker's scrape reads the files, not
the functions. Pure: the registry's own values, no files merged.
"""

from __future__ import annotations

from pathlib import Path

from edge.observe.metrics import EdgeMetrics


def _values(metrics: EdgeMetrics) -> tuple[float | None, float | None]:
    r = metrics.registry
    return (
        r.get_sample_value("iop_edge_node_state", {"node": "a"}),
        r.get_sample_value("iop_edge_backlog_chars"),
    )


def test_a_single_process_reads_the_watched_functions_when_scraped() -> None:
    """Without a multiprocess directory each scrape reads the functions' values now."""
    state, chars = [1.0], [10.0]
    metrics = EdgeMetrics()
    metrics.watch_nodes([("a", lambda: state[0])])
    metrics.watch_backlog(lambda: chars[0])
    assert _values(metrics) == (1.0, 10.0)
    state[0], chars[0] = 3.0, 20.0
    assert _values(metrics) == (3.0, 20.0)


def test_a_worker_writes_the_watched_values_at_each_sync(tmp_path: Path) -> None:
    """In a worker the values are written when watched and at each sync, not between."""
    state, chars = [1.0], [10.0]
    metrics = EdgeMetrics(tmp_path)
    metrics.watch_nodes([("a", lambda: state[0])])
    metrics.watch_backlog(lambda: chars[0])
    assert _values(metrics) == (1.0, 10.0)
    state[0], chars[0] = 3.0, 20.0
    assert _values(metrics) == (1.0, 10.0)
    metrics.sync()
    assert _values(metrics) == (3.0, 20.0)


def test_a_kv_usage_the_node_does_not_say_is_no_series() -> None:
    """A node's KV cache use is a series while the node says it, and none while it does
    not (llama.cpp): unknown is not 0."""
    kv: list[float | None] = [None]
    metrics = EdgeMetrics()
    metrics.watch_node_load([("a", lambda: (0.0, 2.0, kv[0], True))])
    metrics.render()
    r = metrics.registry
    assert r.get_sample_value("iop_edge_node_kv_cache_usage", {"node": "a"}) is None
    assert r.get_sample_value("iop_edge_node_active_runs", {"node": "a"}) == 2.0
    kv[0] = 0.5
    assert b'iop_edge_node_kv_cache_usage{node="a"} 0.5' in metrics.render()
    kv[0] = None
    assert b"iop_edge_node_kv_cache_usage{" not in metrics.render()
