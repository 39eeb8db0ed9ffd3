"""The fleet benchmark's report of the run beside SMG (`benchmarks.fleetreport`): pure
rendering of the result a run wrote."""

from __future__ import annotations

from typing import Any

from benchmarks.fleetreport import goal_rows, render_peers, render_pressure


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


def test_cache_pressure_goals_compare_the_exact_index_with_the_approximate_one_and_smg() -> None:
    """The cache-pressure goals are ratios of the exact index's figures to the approximate
    index's and SMG's in the same mode, each mode's rows its own; the restated hit ratio
    goal is the distance to the workload's ceiling; every table shows the ceiling."""

    def cell(p90: float, out: float, hit: float) -> dict[str, Any]:
        return {**_cell(hit), "ttft_p90_ms": p90, "output_tok_per_s": out,
                "stage_ttft_p90_ms": [p90]}  # fmt: skip

    cells = {
        "cache_aware, approximate": cell(1000.0, 900.0, 0.7),
        "cache_aware, exact": cell(150.0, 1200.0, 0.9),
        "SMG": cell(1000.0, 1000.0, 0.7),
    }
    pressure = {
        "settings": {"stages": [[10.0, 6.0]], "stage_s": 6.0, "groups": 32,
                     "prefix_tokens": 2048, "nodes": 4, "kv_tokens": 22464,
                     "question_words": 32, "prefill_us_per_token": 200.0,
                     "decode_tokens_per_s": 64.0, "max_runs": 8, "other_rate": 3.0,
                     "other_tokens": 2048, "other_nodes": 1},
        "workload": {"requests": 60, "prefix_share": 0.73, "ceiling": 0.95,
                     "capacity_no_reuse": 32.2, "capacity_at_ceiling": 52.9},
        "cells": {"apart": cells, "shared": {**cells, "SMG": cell(100.0, 1300.0, 0.95)}},
    }  # fmt: skip
    result = {"pressure": pressure, "workloads": {"shared": {"ceiling": 0.9}},
              "cells": {"shared": {"cache_aware": _cell(0.87)}}}  # fmt: skip
    rows = {goal: (measured, met) for goal, measured, met in goal_rows(result)}
    apart = "cache pressure (gateway on its own CPU)"
    assert rows[f"{apart}: TTFT p90, exact / approximate <= 1/5"] == ("0.15x", "yes")
    assert rows[f"{apart}: output tok/s, exact / SMG >= 1.2"] == ("1.2x", "yes")
    assert rows[f"{apart}: hit ratio, exact / SMG >= 1.2"] == ("1.29x", "yes")
    assert rows["cache pressure (shared cores): TTFT p90, exact / SMG <= 1/5"] == ("1.5x", "NO")
    assert rows["shared prefixes: hit ratio, ceiling - cache_aware <= 0.05 (ceiling 0.900)"] == (
        "0.03",
        "yes",
    )
    text = "\n".join(render_pressure(pressure))
    assert text.count("| 0.950   |") == 6


def test_the_replicas_cells_have_a_table_and_goal_rows_of_their_own() -> None:
    """The cells with each gateway replicated (`replicas`) are a table of their own, titled
    with the count, and each cache-pressure goal is a row of theirs too."""
    cell = {**_cell(0.85), "ttft_p90_ms": 400.0, "output_tok_per_s": 990.0}
    smg = {**_cell(0.5), "ttft_p90_ms": 3600.0, "output_tok_per_s": 930.0}
    pressure = {
        "settings": {"stages": [[10.0, 6.0]], "stage_s": 6.0, "groups": 32,
                     "prefix_tokens": 2048, "nodes": 4, "kv_tokens": 22464,
                     "question_words": 32, "prefill_us_per_token": 200.0,
                     "decode_tokens_per_s": 64.0, "max_runs": 8, "other_rate": 3.0,
                     "other_tokens": 2048, "other_nodes": 1, "replicas": 3},
        "workload": {"requests": 60, "prefix_share": 0.73, "ceiling": 0.95,
                     "capacity_no_reuse": 32.2, "capacity_at_ceiling": 52.9},
        "cells": {"replicas": {"cache_aware, exact": cell, "SMG": smg}},
    }  # fmt: skip
    rows = {goal: (measured, met) for goal, measured, met in goal_rows({"pressure": pressure})}
    assert rows["cache pressure (3 gateway replicas): hit ratio, exact / SMG >= 1.2"] == (
        "1.7x",
        "yes",
    )
    assert rows["cache pressure (3 gateway replicas): TTFT p90, exact / SMG <= 1/5"] == (
        "0.111x",
        "yes",
    )
    text = "\n".join(render_pressure(pressure))
    assert "cache pressure, 3 replicas of each gateway, the requests spread over them" in text
