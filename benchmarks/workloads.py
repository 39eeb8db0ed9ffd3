"""The orchestrator of `make bench`: which workloads run, in which order, within the budget.

Runs in the parent process, which does no load itself: it starts the stack and the
load-generator pool, warms up, measures the repeated workloads in rounds (the edge and
the direct path swap order each round), then the ones measured once. The whole run is
bounded by a time budget (optional parts are skipped, and say so, once it is spent).
How each workload is measured is in `benchmarks.harness`, `benchmarks.once` and
`benchmarks.paced`.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks import once, paced
from benchmarks.harness import Bench, Settings, mono
from benchmarks.loadgen import Pool
from benchmarks.report import sig
from benchmarks.stack import Stack


def measure_round(bench: Bench, rnd: int) -> dict[str, Any]:
    """One round of the repeated workloads; the edge and the direct path swap order."""
    from benchmarks.calibrate import calibrate

    s = bench.settings
    order = ("edge", "direct") if rnd % 2 == 0 else ("direct", "edge")
    # The yardstick is taken before every workload and the round uses the median: one
    # sample catches one moment of a shared machine (a busy SMT sibling halves it).
    samples = [calibrate()]
    r: dict[str, Any] = {}
    bench.log(f"round {rnd + 1}/{s.rounds}: ttft x{s.ttft_samples}")
    r["ttft"] = bench.ttft(s.ttft_samples)
    samples.append(calibrate())
    bench.log(f"round {rnd + 1}/{s.rounds}: 1 x {s.long_chunks}")
    r["one_stream"] = {}
    for via in order:
        r["one_stream"][via] = bench.streams(via, 1, s.long_chunks, 120.0)
        bench.settle()
    samples.append(calibrate())
    r["concurrency"] = {}
    for count, chunks in s.concurrency:
        bench.log(f"round {rnd + 1}/{s.rounds}: {count} x {chunks}")
        key = f"{count}x{chunks}"
        r["concurrency"][key] = {}
        for via in order:
            r["concurrency"][key][via] = bench.streams(via, count, chunks, 120.0)
            bench.settle()
        samples.append(calibrate())
    r["nonstream"] = {}
    for rps in s.rates:
        bench.log(f"round {rnd + 1}/{s.rounds}: non-stream {rps:g} req/s x {s.rate_seconds:g} s")
        key = f"{rps:g}rps"
        r["nonstream"][key] = {}
        for via in order:
            r["nonstream"][key][via] = bench.rate(via, rps, s.rate_seconds)
            bench.settle()
        samples.append(calibrate())
    r["paced"] = {}
    for count, tps, seconds in s.paced:
        bench.log(f"round {rnd + 1}/{s.rounds}: paced {count} x {tps:g} tokens/s x {seconds:g} s")
        key = f"{count}x{tps:g}"
        r["paced"][key] = {}
        for via in order:
            r["paced"][key][via] = paced.measure(bench, via, count, tps, seconds)
            bench.settle()
        samples.append(calibrate())
    r["calibration_us"] = statistics.median(samples)
    r["calibration_samples_us"] = [sig(x) for x in samples]
    return r


def run_workloads(bench: Bench) -> dict[str, Any]:
    """Every workload, in rounds; returns the raw per-round figures and the one-off ones."""
    s = bench.settings
    raw: dict[str, Any] = {"rounds": [], "once": {}}
    bench.log("warm-up")
    bench.warm_up()
    conc_big = max(s.concurrency, default=None)
    bench.log("load generator alone (replay server)")
    raw["once"]["client_alone"] = once.client_alone(bench, s.long_chunks, conc_big)
    for rnd in range(s.rounds):
        if rnd > 0 and bench.left() < 60:
            bench.log(f"round {rnd + 1}: skipped, the time budget is spent")
            break
        raw["rounds"].append(measure_round(bench, rnd))
    bench.log(f"disconnect -> CancelRun x{s.disconnect_samples}")
    raw["once"]["disconnect"] = once.disconnects(bench, s.disconnect_samples)
    raw["once"]["open_streams"] = {}
    for count in s.open_streams:
        if bench.left() < 20 + count / 250:
            bench.log(f"{count} open streams: skipped, the time budget is spent")
            raw["once"]["open_streams"][str(count)] = {"skipped": "time budget"}
            continue
        bench.log(f"{count} open streams")
        raw["once"]["open_streams"][str(count)] = once.open_streams(bench, count)
    return raw


def run(settings: Settings, tmp: Path) -> dict[str, Any]:
    """Start everything, measure, stop everything (whatever happens)."""
    with Stack(tmp) as stack:
        pool = Pool(settings.clients)
        try:
            bench = Bench(stack, pool, settings)
            bench.log(
                f"edge pid {bench.edge.pid} on :{stack.edge_port}, "
                f"node pid {bench.node.pid} on :{stack.node_port}, clients {pool.pids}"
            )
            raw = run_workloads(bench)
            raw["edge_rss_end_mib"] = bench.edge.rss() / 2**20
            raw["elapsed_s"] = mono() - bench.started
            return raw
        finally:
            pool.close()
