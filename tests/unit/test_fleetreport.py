"""The fleet benchmark's report of the run beside SMG (`benchmarks.fleetreport`): pure
rendering of the result a run wrote."""

from __future__ import annotations

from typing import Any

from benchmarks.fleetreport import goal_rows, render_peers


def _cell(hit: float) -> dict[str, Any]:
    return {"hit_ratio": hit, "ttft_p50_ms": 30.0, "ttft_p99_ms": 300.0, "req_per_s": 100.0,
            "busiest_share": 0.3, "runs_per_node": [1, 1, 1, 1], "cpu_per_req_us": 700,
            "errors": 0}  # fmt: skip


def test_cells_measured_before_a_failure_are_reported_with_the_failure() -> None:
    """A run whose later cell failed (a port taken, say) still shows the cells it measured,
    then says where it stopped and why."""
    result = {
        "settings": {"nodes": 4, "kv_tokens": 1024}, "smg_version": "1.13.0",
        "edge_policy": "cache_aware",
        "cells": {"shared": {"SMG": _cell(0.8), "iop-edge": _cell(0.82)}},
        "error": "SMG on hot: SMG did not start",
    }  # fmt: skip
    text = "\n".join(render_peers(result))
    assert "0.820" in text
    assert "0.800" in text
    assert text.rstrip().endswith("Beside SMG: stopped there (SMG on hot: SMG did not start)")


def test_a_run_that_measured_nothing_says_why() -> None:
    """No settings (the run stopped before its first cell): one line with the reason."""
    assert render_peers({"error": "no smg binary"}) == ["\nBeside SMG: not run (no smg binary)"]


def test_cells_with_the_gateway_apart_have_tables_and_goals_of_their_own() -> None:
    """The cells measured with the gateway on a CPU of its own follow the shared ones,
    each workload's table titled so, and their goals are rows of their own: the same
    workload's figures of the two modes are never mixed."""
    slow, fast = {**_cell(0.8), "ttft_p50_ms": 60.0}, {**_cell(0.8), "ttft_p50_ms": 20.0}
    peers = {
        "settings": {"nodes": 4, "kv_tokens": 1024}, "smg_version": "1.13.0",
        "edge_policy": "cache_aware",
        "cells": {"shared": {"SMG": _cell(0.8), "iop-edge": slow}},
        "cells_apart": {"shared": {"SMG": _cell(0.8), "iop-edge": fast}},
    }  # fmt: skip
    text = "\n".join(render_peers(peers))
    assert text.index("shared prefixes\n") < text.index("shared prefixes, the gateway on a CPU")
    rows = {goal: (measured, met) for goal, measured, met in goal_rows({"peers": peers})}
    assert rows["beside SMG, shared prefixes: TTFT p50, edge / SMG <= 1"] == ("2x", "NO")
    assert rows[
        "beside SMG (gateway on its own CPU), shared prefixes: TTFT p50, edge / SMG <= 1"
    ] == ("0.667x", "yes")
