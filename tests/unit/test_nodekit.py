"""The runs log every node shares (`edge.nodekit.RunsLog`): what it keeps in memory.

A node serves for months: in memory it keeps the runs in flight and a window of
the last records, never one record per run it ever served; the file gets them all.
"""

from __future__ import annotations

import json
from pathlib import Path

from edge.nodekit import FINISHED_KEPT, RunsLog


def test_runs_log_keeps_a_bounded_window_of_records(tmp_path: Path) -> None:
    """After more runs than the window, the records kept in memory stay at FINISHED_KEPT
    (the latest ones, in order), nothing else per run is left, and the file has every line."""
    path = tmp_path / "runs.jsonl"
    log = RunsLog(path)
    total = FINISHED_KEPT * 2 + 17
    for i in range(total):
        run = log.start(f"run{i}", "sim-echo")
        run.outcome = "complete"
        log.ended(run)
        assert len(log.finished) == min(i + 1, FINISHED_KEPT)
    log.close()
    assert [r["run_id"] for r in log.finished] == [
        f"run{i}" for i in range(total - FINISHED_KEPT, total)
    ]
    assert log.active == 0
    assert not log._runs
    lines = path.read_text().splitlines()
    assert len(lines) == total
    assert json.loads(lines[-1])["run_id"] == f"run{total - 1}"


def test_unknown_cancel_rpcs_are_bounded_too() -> None:
    """CancelRuns for ids the node does not know (one record each) fill the same window."""
    log = RunsLog()
    for i in range(FINISHED_KEPT + 50):
        assert log.cancel_rpc(f"nope{i}") == (None, False)
    assert len(log.finished) == FINISHED_KEPT
    last = {"type": "cancel_rpc", "run_id": f"nope{FINISHED_KEPT + 49}", "found": False}
    assert log.finished[-1] == last
