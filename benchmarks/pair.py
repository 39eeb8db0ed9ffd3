"""Two edges side by side: this tree and git revision REV, under the same paced load at once.

    python -m benchmarks.pair --rev REV [--paced 25x50x12] [--rounds 3]
    python -m benchmarks.pair --tracing   # B: this tree with tracing on (ratio 1.0)

The `--ab` runs alternate A and B, so a machine whose speed drifts between runs (other
work on a shared box) moves one side and not the other. Here both edges run at the same
time against one simulated node, each with a load-generator process of its own offering
the same paced streams with the same start times, so both see the same machine at the
same moment; the ratio of their CPU per chunk is the figure, in the paced workload's
steady window (`benchmarks.paced`; per token, no stream opens or ends in it) and over
the whole round (opens, ends and a tracing edge's export of the spans included). Keep
the total load below saturation (two edges, the node and two clients share the cores):
25 x 50 per edge on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.ab import checkout, edge_module_path, remove_checkout, tree_label
from benchmarks.cleanup import remove_dir, run_program, temp_dir
from benchmarks.harness import Bench, Settings
from benchmarks.loadgen import Pool
from benchmarks.paced import (
    SAMPLE_EVERY_S,
    START_DELAY_S,
    Plan,
    _interpolate,
    _streams_of,
    steady_window,
    window_figures,
)
from benchmarks.report import pct
from benchmarks.stack import EdgeSource, Stack
from benchmarks.tracing import EXPORT_DELAY_MS, otlp_sink

mono = time.monotonic


def one_round(
    benches: list[Bench], pool: Pool, count: int, rate: float, seconds: float
) -> list[dict[str, Any]]:
    """The same paced streams through every edge at once; per edge: CPU/chunk, gaps."""
    plan = Plan.of(count, rate, seconds)
    for i, bench in enumerate(benches):
        pool.submit(
            i, "paced_edge", host=bench.host, port=bench.port,
            request=bench.post(plan.script, stream=True), count=count, offset=0,
            **plan.job_args(count),
        )  # fmt: skip
    samples: list[list[tuple[float, float, float]]] = [[] for _ in benches]
    waiting = list(range(len(benches)))
    limit = mono() + START_DELAY_S + plan.timeout_s + 30
    while waiting and mono() < limit:
        for i, bench in enumerate(benches):
            samples[i].append((mono(), bench.edge.cpu(), 0.0))
        waiting = [i for i in waiting if not pool.ready(i, SAMPLE_EVERY_S / len(benches))]
    # Whatever the edges still do for these streams (their ends, a tracing edge's export
    # of their spans, every EXPORT_DELAY_MS) is in the whole-round figure.
    time.sleep(4 * EXPORT_DELAY_MS / 1000)
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
        ms, frames = window_figures(streams, w0, w1)
        (e0, _), (e1, _) = _interpolate(samples[i], w0), _interpolate(samples[i], w1)
        whole = samples[i][-1][1] - samples[i][0][1]
        out.append(
            {
                "cpu_us_per_chunk": (e1 - e0) * 1e6 / max(frames, 1),
                # From before the first stream opened to after the last one ended.
                "whole_cpu_us_per_chunk": whole * 1e6 / max(part["chunks"], 1),
                "chunks_per_s": frames / (w1 - w0),
                "gap_p50_ms": pct(ms, 50),
                "gap_p99_ms": pct(ms, 99),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--rev", help="B: the edge of this git revision")
    which.add_argument(
        "--tracing",
        action="store_true",
        help="B: this tree's edge with tracing on (ratio 1.0, OTLP/HTTP to a sink here)",
    )
    parser.add_argument("--paced", default="25x50x12", help="COUNTxTOKENS_PER_SxSECONDS per edge")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the rounds as JSON here")
    args = parser.parse_args(argv)
    count_s, rate_s, seconds_s = args.paced.split("x")
    count, rate, seconds = int(count_s), float(rate_s), float(seconds_s)
    tmp = temp_dir("iop-pair-")
    where: Path | None = None
    with ExitStack() as cleanup:
        cleanup.callback(remove_dir, tmp)
        extra = ""
        if args.tracing:
            sink = cleanup.enter_context(otlp_sink())
            extra = f'\n[tracing]\nenabled = true\nendpoint = "{sink.url}"\nsample_ratio = 1.0\n'
            delay = ("OTEL_BSP_SCHEDULE_DELAY", str(EXPORT_DELAY_MS))
            b_source = EdgeSource(label="this tree, tracing on (ratio 1.0)", env=(delay,))
        else:
            _, where, b_source = checkout(args.rev, tmp)
            cleanup.callback(remove_checkout, where)
        labels = [tree_label(), b_source.label]
        rounds = _pair(tmp, b_source, extra, args.rounds, count, rate, seconds)
        if args.tracing:
            print(f"the OTLP sink took {sink.exports} exports, {sink.bytes} bytes", file=sys.stderr)
    print(render(labels, args.paced, rounds))
    if args.out:
        args.out.write_text(json.dumps({"labels": labels, "paced": args.paced, "rounds": rounds}))
    return 0


def _pair(
    tmp: Path, b_source: EdgeSource, b_extra: str, n: int, count: int, rate: float, seconds: float
) -> list[list[dict[str, Any]]]:
    rounds: list[list[dict[str, Any]]] = []
    for source in (EdgeSource(), b_source):
        print(f"{source.label}: edge from {edge_module_path(source)}", file=sys.stderr)
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    with (
        Stack(tmp / "a") as a,
        Stack(tmp / "b", b_source, node_port=a.node_port, extra_config=b_extra) as b,
    ):
        b.node_probe = a.node_probe  # one node: `settle` watches it from both
        pool = Pool(2)
        try:
            settings = Settings(clients=2, budget_s=3600)
            benches = [Bench(a, pool, settings), Bench(b, pool, settings)]
            for bench in benches:
                bench.warm_up()
            for r in range(n):
                benches[0].settle()
                benches[1].settle()
                result = one_round(benches, pool, count, rate, seconds)
                rounds.append(result)
                print(f"round {r + 1}: {json.dumps(result)}", file=sys.stderr)
        finally:
            pool.close()
    return rounds


def render(labels: list[str], shape: str, rounds: list[list[dict[str, Any]]]) -> str:
    lines = [
        f"paced {shape} per edge, both edges at once; A = {labels[0]}, B = {labels[1]}",
        "| round | A CPU/chunk | B CPU/chunk | A/B | whole round A/B | A gap p99 | B gap p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    wholes = []
    for i, (x, y) in enumerate(rounds, 1):
        if "failed" in x or "failed" in y:
            lines.append(f"| {i} | {x.get('failed', '')} | {y.get('failed', '')} | | | |")
            continue
        ratio = x["cpu_us_per_chunk"] / y["cpu_us_per_chunk"]
        whole = x["whole_cpu_us_per_chunk"] / y["whole_cpu_us_per_chunk"]
        ratios.append(ratio)
        wholes.append(whole)
        lines.append(
            f"| {i} | {x['cpu_us_per_chunk']:.0f} us | {y['cpu_us_per_chunk']:.0f} us"
            f" | {ratio:.3f} | {whole:.3f} | {x['gap_p99_ms']:.1f} ms | {y['gap_p99_ms']:.1f} ms |"
        )
    for name, values in (("in the steady window", ratios), ("whole round", wholes)):
        if values:
            values.sort()
            lines.append(
                f"A/B CPU per chunk, {name}: median {values[len(values) // 2]:.3f}"
                f" ({values[0]:.3f}..{values[-1]:.3f})"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(run_program(main, "benchmarks.pair"))
