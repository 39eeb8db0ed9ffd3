"""The workloads measured once per run (`raw["once"]`): the load generator alone, the
disconnect -> CancelRun latency, and many open streams (RSS, then closing them all).

Functions of a started `Bench` (`benchmarks.harness`), like `benchmarks.paced.measure`:
they use its probes, clients and clock, and must not know the rounds or the time
budget's plan (`benchmarks.workloads` decides whether each runs).
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from benchmarks.cleanup import child_options
from benchmarks.harness import START_DELAY_S, Bench, mono
from benchmarks.httpclient import build_post
from benchmarks.report import pct
from benchmarks.scripts import HANG_SCRIPT
from benchmarks.stack import node_active_runs, stop_process


def client_alone(bench: Bench, chunks: int, conc: tuple[int, int] | None) -> dict[str, Any]:
    """The load generator against a trivially fast server (benchmarks.replay)."""
    out: dict[str, Any] = {}
    cases = [("one_stream", (1, chunks))] + ([("concurrency", conc)] if conc else [])
    for label, (count, n) in cases:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.replay", str(n)],
            stdout=subprocess.PIPE,
            text=True,
            **child_options(),
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"replay server did not start: {line!r}")
            port = int(line.rsplit(":", 1)[1])
            request = build_post(bench.host, port, "/v1/chat/completions", b"{}")
            start_at = mono() + START_DELAY_S
            workers = min(bench.pool.size, max(1, count // 100))
            bench.pool.spread(
                workers,
                "streams",
                count,
                host=bench.host,
                port=port,
                request=request,
                connect_limit=bench.settings.connect_limit,
                start_at=start_at,
                timeout_s=60.0,
            )
            parts = [bench.pool.result(i, 90.0) for i in range(workers)]
        finally:
            stop_process(proc)
        wall = max(p["t_end"] for p in parts) - min(p["t_start"] for p in parts)
        total = sum(p["chunks"] for p in parts)
        out[f"{label}_{count}x{n}"] = {
            "chunks_per_s": total / wall if wall > 0 else None,
            "client_cpu_us_per_chunk": sum(p["cpu_s"] for p in parts) * 1e6 / max(total, 1),
            "chunks": total,
        }
    return out


def _cancel_latencies(
    bench: Bench, closed: list[tuple[str, float]] | dict[str, float], wait_s: float
) -> dict[str, Any]:
    pairs = list(closed.items()) if isinstance(closed, dict) else list(closed)
    ids = {run_id for run_id, _ in pairs}
    got = bench.stack.runs_log.wait_for(ids, wait_s)
    latencies: list[float] = []
    with_rpc = 0
    for run_id, t_close in pairs:
        entry = bench.stack.runs_log.get(run_id)
        if entry is None:
            continue
        at, record = entry
        if record.get("cancel_rpc"):
            with_rpc += 1
            latencies.append((at - t_close) * 1e3)
    return {
        "runs": len(pairs),
        "ended_on_node": got,
        "with_cancel_rpc": with_rpc,
        "p50_ms": pct(latencies, 50),
        "p99_ms": pct(latencies, 99),
        "max_ms": max(latencies) if latencies else None,
    }


def disconnects(bench: Bench, samples: int) -> dict[str, Any]:
    result = bench.pool.run(
        "disconnects",
        wait_s=120.0,
        host=bench.host,
        port=bench.port,
        node_port=bench.stack.node_port,
        edge_request=bench.post(HANG_SCRIPT, stream=True),
        script=HANG_SCRIPT,
        samples=samples,
        pause_s=0.02,
        timeout_s=60.0,
    )
    edge = _cancel_latencies(bench, [(r, t) for r, t in result["edge"]], 10.0)
    direct = _cancel_latencies(bench, [(r, t) for r, t in result["direct"]], 10.0)
    out = {
        "samples": edge["runs"],
        "edge_p50_ms": edge["p50_ms"],
        "edge_p99_ms": edge["p99_ms"],
        "edge_with_cancel_rpc": edge["with_cancel_rpc"],
        "direct_p50_ms": direct["p50_ms"],
        "direct_p99_ms": direct["p99_ms"],
        "direct_with_cancel_rpc": direct["with_cancel_rpc"],
    }
    if edge["p50_ms"] is not None and direct["p50_ms"] is not None:
        out["added_p50_ms"] = edge["p50_ms"] - direct["p50_ms"]
    return out


def open_streams(bench: Bench, count: int) -> dict[str, Any]:
    """Hold `count` streams open (the node hangs after one delta): RSS; then close all."""
    bench.settle()
    active0 = node_active_runs(bench.stack.node_port) or 0
    rss0 = bench.edge.rss()
    node_rss0 = bench.node.rss()
    e0, n0 = bench.cpus()
    workers = bench.pool.size if count >= 200 else 1
    request = bench.post(HANG_SCRIPT, stream=True)
    open_timeout = max(30.0, min(150.0, bench.left() - 30.0))
    t0 = mono()
    bench.pool.spread(
        workers,
        "open_streams",
        count,
        host=bench.host,
        port=bench.port,
        request=request,
        connect_limit=bench.settings.connect_limit,
        timeout_s=open_timeout,
    )
    reports = [bench.pool.result(i, open_timeout + 30.0) for i in range(workers)]
    open_s = mono() - t0
    e1, n1 = bench.cpus()
    time.sleep(1.0)
    rss1 = bench.edge.rss()
    node_rss1 = bench.node.rss()
    opened = sum(r["opened"] for r in reports)
    late0 = bench.stack.runs_log.unknown_cancels
    gave_up0 = bench.stack.edge_log().count("CancelRun for run")
    e2 = bench.edge.cpu()
    for i in range(workers):
        bench.pool.send(i, "close")
    # The node's own count of live runs says when every run has ended there (by the
    # stream reset or by CancelRun, whichever came first); bounded.
    ended_at: float | None = None
    limit = mono() + max(15.0, min(60.0, bench.left()))
    while mono() < limit:
        active = node_active_runs(bench.stack.node_port)
        if active is not None and active <= active0:
            ended_at = mono()
            break
        time.sleep(0.05)
    closed: dict[str, float] = {}
    for i in range(workers):
        closed.update(bench.pool.result(i, 60.0)["closed"])
    e3 = bench.edge.cpu()
    # Runs-log lines: at once on CancelRun, else 1 s after the reset (the node's grace).
    cancel = _cancel_latencies(bench, closed, wait_s=2.5)
    first_close = min(closed.values(), default=None)
    bench.settle(10.0)
    rss2 = bench.edge.rss()
    out = {
        "streams": count,
        "opened": opened,
        "open_errors": sum(r["errors"] + r["unfinished"] for r in reports),
        "open_s": open_s,
        "opens_per_s": opened / open_s if open_s > 0 else None,
        "edge_cpu_ms_per_open": (e1 - e0) * 1e3 / max(opened, 1),
        "node_cpu_ms_per_open": (n1 - n0) * 1e3 / max(opened, 1),
        "client_cpu_ms_per_open": sum(r["cpu_s"] for r in reports) * 1e3 / max(opened, 1),
        "rss_before_mib": rss0 / 2**20,
        "rss_with_streams_mib": rss1 / 2**20,
        "rss_after_close_mib": rss2 / 2**20,
        "rss_kib_per_stream": (rss1 - rss0) / 1024 / max(opened, 1),
        "node_rss_kib_per_stream": (node_rss1 - node_rss0) / 1024 / max(opened, 1),
        "all_ended_on_node_s": None
        if ended_at is None or first_close is None
        else ended_at - first_close,
        "cancel_rpc_in_grace": cancel["with_cancel_rpc"],
        "cancel_rpc_late": bench.stack.runs_log.unknown_cancels - late0,
        "cancel_rpc_gave_up": bench.stack.edge_log().count("CancelRun for run") - gave_up0,
        "cancel_p50_ms": cancel["p50_ms"],
        "cancel_p99_ms": cancel["p99_ms"],
        "edge_cpu_ms_per_close": (e3 - e2) * 1e3 / max(opened, 1),
        "bad_statuses": {
            str(k): v for r in reports for k, v in (r.get("bad_statuses") or {}).items()
        },
    }
    first = next((r["first_error"] for r in reports if r["first_error"]), None)
    if first:
        out["first_error"] = first
    return out
