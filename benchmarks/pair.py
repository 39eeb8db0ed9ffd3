"""Two edges side by side: this tree and git revision REV, under the same paced load at once.

    python -m benchmarks.pair --rev REV [--paced 25x50x12] [--rounds 3]

The `--ab` runs alternate A and B, so a machine whose speed drifts between runs (other
work on a shared box) moves one side and not the other. Here both edges run at the same
time against one simulated node, each with a load-generator process of its own offering
the same paced streams with the same start times, so both see the same machine at the
same moment; the ratio of their CPU per chunk is the figure. The window is the paced
workload's steady window (`benchmarks.paced`), per edge. Keep the total load below
saturation (two edges, the node and two clients share the cores): 25 x 50 per edge on
2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

from benchmarks.ab import checkout, edge_module_path, remove_checkout, tree_label
from benchmarks.loadgen import Pool
from benchmarks.paced import (
    RAMP_BOUNDS_S,
    RAMP_PER_STREAM_S,
    SAMPLE_EVERY_S,
    START_DELAY_S,
    _interpolate,
    _streams_of,
    paced_script,
    steady_window,
    window_gaps,
)
from benchmarks.report import pct
from benchmarks.stack import EdgeSource, Stack
from benchmarks.workloads import Bench, Settings

mono = time.monotonic


def one_round(
    benches: list[Bench], pool: Pool, count: int, rate: float, seconds: float
) -> list[dict[str, Any]]:
    """The same paced streams through every edge at once; per edge: CPU/chunk, gaps."""
    tokens = max(2, round(rate * seconds))
    script = paced_script(tokens, rate)
    lo, hi = RAMP_BOUNDS_S
    ramp = min(max(lo, count * RAMP_PER_STREAM_S), hi, seconds / 3)
    start_at = mono() + START_DELAY_S
    timeout_s = seconds * 3 + 30.0
    for i, bench in enumerate(benches):
        pool.submit(
            i, "paced_edge", host=bench.host, port=bench.port,
            request=bench.post(script, stream=True), count=count, offset=0, total=count,
            start_at=start_at, ramp_s=ramp, timeout_s=timeout_s,
        )  # fmt: skip
    samples: list[list[tuple[float, float, float]]] = [[] for _ in benches]
    waiting = list(range(len(benches)))
    limit = mono() + START_DELAY_S + timeout_s + 30
    while waiting and mono() < limit:
        for i, bench in enumerate(benches):
            samples[i].append((mono(), bench.edge.cpu(), 0.0))
        waiting = [i for i in waiting if not pool.ready(i, SAMPLE_EVERY_S / len(benches))]
    out = []
    for i, bench in enumerate(benches):
        samples[i].append((mono(), bench.edge.cpu(), 0.0))
        part = pool.result(i, 1.0)
        streams = _streams_of(part)
        window = steady_window(streams)
        if window is None or part["ok"] < count:
            out.append({"failed": part.get("first_error") or "no steady window"})
            continue
        w0, w1 = window
        gaps: array[float] = array("d")
        frames = 0
        for stamps in streams:
            g, n = window_gaps(stamps, w0, w1)
            gaps.extend(g)
            frames += n
        (e0, _), (e1, _) = _interpolate(samples[i], w0), _interpolate(samples[i], w1)
        ms = [g * 1e3 for g in gaps]
        out.append(
            {
                "cpu_us_per_chunk": (e1 - e0) * 1e6 / max(frames, 1),
                "chunks_per_s": frames / (w1 - w0),
                "gap_p50_ms": pct(ms, 50),
                "gap_p99_ms": pct(ms, 99),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the git revision to compare against")
    parser.add_argument("--paced", default="25x50x12", help="COUNTxTOKENS_PER_SxSECONDS per edge")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the rounds as JSON here")
    args = parser.parse_args(argv)
    count_s, rate_s, seconds_s = args.paced.split("x")
    count, rate, seconds = int(count_s), float(rate_s), float(seconds_s)
    tmp = Path(tempfile.mkdtemp(prefix="iop-pair-"))
    _, where, rev_source = checkout(args.rev, tmp)
    labels = [tree_label(), rev_source.label]
    rounds: list[list[dict[str, Any]]] = []
    try:
        for source in (EdgeSource(), rev_source):
            print(f"{source.label}: edge from {edge_module_path(source)}", file=sys.stderr)
        (tmp / "a").mkdir()
        (tmp / "b").mkdir()
        with Stack(tmp / "a") as a, Stack(tmp / "b", rev_source, node_port=a.node_port) as b:
            b.node_probe = a.node_probe  # one node: `settle` watches it from both
            pool = Pool(2)
            try:
                settings = Settings(clients=2, budget_s=3600)
                benches = [Bench(a, pool, settings), Bench(b, pool, settings)]
                for bench in benches:
                    bench.warm_up()
                for r in range(args.rounds):
                    benches[0].settle()
                    benches[1].settle()
                    result = one_round(benches, pool, count, rate, seconds)
                    rounds.append(result)
                    print(f"round {r + 1}: {json.dumps(result)}", file=sys.stderr)
            finally:
                pool.close()
    finally:
        remove_checkout(where)
    print(render(labels, args.paced, rounds))
    if args.out:
        args.out.write_text(json.dumps({"labels": labels, "paced": args.paced, "rounds": rounds}))
    return 0


def render(labels: list[str], shape: str, rounds: list[list[dict[str, Any]]]) -> str:
    lines = [
        f"paced {shape} per edge, both edges at once; A = {labels[0]}, B = {labels[1]}",
        "| round | A CPU/chunk | B CPU/chunk | A/B | A gap p99 | B gap p99 |",
        "|---|---|---|---|---|---|",
    ]
    ratios = []
    for i, (x, y) in enumerate(rounds, 1):
        if "failed" in x or "failed" in y:
            lines.append(f"| {i} | {x.get('failed', '')} | {y.get('failed', '')} | | | |")
            continue
        ratio = x["cpu_us_per_chunk"] / y["cpu_us_per_chunk"]
        ratios.append(ratio)
        lines.append(
            f"| {i} | {x['cpu_us_per_chunk']:.0f} us | {y['cpu_us_per_chunk']:.0f} us"
            f" | {ratio:.3f} | {x['gap_p99_ms']:.1f} ms | {y['gap_p99_ms']:.1f} ms |"
        )
    if ratios:
        ratios.sort()
        lines.append(
            f"A/B CPU per chunk: median {ratios[len(ratios) // 2]:.3f}"
            f" ({ratios[0]:.3f}..{ratios[-1]:.3f})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
