"""`make bench` / `python -m benchmarks`: measure the edge, print a table, write JSON.

Flags: `--quick` (a ~1 minute smoke run with smaller sizes), `--rounds N`, `--clients N`
(load-generator processes), sizes (`--ttft-samples`, `--long-chunks`, `--concurrency`,
`--open-streams`, `--rates`, `--rate-seconds`, `--disconnects`), `--budget-s`, `--out`,
`--keep` (keep the temporary directory with the edge's and the node's logs), `--paced`
(the paced workload's sizes), `--overload-only` / `--no-overload` (the overload curve,
`benchmarks.overload`; with `--ab REV` the curve on both sides), `--peers` (also run
the peer tool with LiteLLM and SMG; it installs both into ~/.cache) and `--ab REV`
(A/B against a git revision), `--workers-only` / `--no-workers` (throughput by worker
count, `benchmarks.workers`), `--tracing-only` / `--no-tracing` (the edge's CPU per
request and per chunk with tracing off and on, `benchmarks.tracing`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.harness import Settings
from benchmarks.jobs.base import raise_nofile
from benchmarks.loadgen import Pool
from benchmarks.overload import QUICK as OVERLOAD_QUICK
from benchmarks.overload import OverloadSettings, measure_overload, render_overload
from benchmarks.report import diff, dig, fmt, fmt_range, fold, goal_rows, med, ratio, sig, table
from benchmarks.stack import EdgeSource
from benchmarks.workloads import run

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "latest.json"
PACKAGES = (
    "trio",
    "trio-asyncio",
    "hypercorn",
    "quart",
    "quart-trio",
    "h11",
    "grpclib",
    "h2",
    "betterproto2",
    "msgspec",
    "psutil",
)


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        if item.strip():
            count, _, chunks = item.strip().partition("x")
            out.append((int(count), int(chunks)))
    return out


def _paced(text: str) -> list[tuple[int, float, float]]:
    """COUNTxRATE[xSECONDS],...; a missing SECONDS is 0 (then --paced-seconds)."""
    out = []
    for item in text.split(","):
        if item.strip():
            parts = item.strip().split("x")
            seconds = float(parts[2]) if len(parts) > 2 else 0.0
            out.append((int(parts[0]), float(parts[1]), seconds))
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--quick", action="store_true", help="~1 minute smoke run, smaller sizes")
    p.add_argument("--rounds", type=int, help="rounds of the repeated workloads (default 3)")
    p.add_argument("--clients", type=int, help="load-generator processes (default 2)")
    p.add_argument("--ttft-samples", type=int, help="TTFT samples per round (default 300)")
    p.add_argument("--long-chunks", type=int, help="deltas of the one-stream run (20000)")
    p.add_argument("--concurrency", type=_pairs, help="COUNTxCHUNKS,... (100x200,1000x20)")
    p.add_argument("--open-streams", type=_ints, help="idle open streams, N,... (1000,10000)")
    p.add_argument("--rates", type=_floats, help="non-stream req/s, R,... (100,1000)")
    p.add_argument("--rate-seconds", type=float, help="seconds per fixed-rate run (4)")
    p.add_argument(
        "--paced",
        type=_paced,
        help="paced streams, COUNTxTOKENS_PER_S[xSECONDS],... (1000x1x14,50x50x8; 1000x50 "
        "needs many cores)",
    )
    p.add_argument("--paced-seconds", type=float, help="seconds of a paced shape given without (8)")
    p.add_argument("--disconnects", type=int, help="disconnect -> CancelRun samples (40)")
    p.add_argument("--budget-s", type=float, help="time budget of the whole run (420 s)")
    p.add_argument(
        "--out", type=Path, default=None, help="the JSON result file (results/latest.json)"
    )
    p.add_argument("--keep", action="store_true", help="keep the temp dir with the logs")
    p.add_argument(
        "--peers",
        action="store_true",
        help="also measure LiteLLM and SMG on one upstream with the edge, with the peer tool "
        "../shared/tools/peer-bench (installs litellm and smg into ~/.cache on first use: "
        "large, slow; adds 10+ minutes, not part of the time budget)",
    )
    p.add_argument("--litellm", action="store_true", help="the same as --peers (old name)")
    p.add_argument("--peer-tool", type=Path, default=None, help="path of the peer tool")
    p.add_argument(
        "--smg",
        type=Path,
        default=None,
        metavar="BIN",
        help="SMG executable for --peers (default: smg pinned in ~/.cache/iop-edge/smg-venv, "
        "installed on first use)",
    )
    p.add_argument("--no-smg", action="store_true", help="--peers without SMG")
    p.add_argument(
        "--peers-only",
        action="store_true",
        help="only the peer tool's run (the edge, LiteLLM and SMG on one upstream); "
        "writes results/peers.json",
    )
    p.add_argument(
        "--ab",
        metavar="REV",
        default=None,
        help="A/B: the headline workloads against this tree and git revision REV "
        "(a temporary git worktree), alternating, in calibration units",
    )
    p.add_argument("--ab-pairs", type=int, default=3, help="A/B pairs of runs (default 3)")
    p.add_argument(
        "--overload-only",
        action="store_true",
        help="only the overload curve (with --ab REV: on this tree, then on REV); "
        "writes results/overload.json",
    )
    p.add_argument("--no-overload", action="store_true", help="leave the overload curve out")
    p.add_argument(
        "--workers-only",
        action="store_true",
        help="only throughput by worker count (1 and 2 workers); writes results/workers.json",
    )
    p.add_argument("--no-workers", action="store_true", help="leave the worker-count run out")
    p.add_argument(
        "--tracing-only",
        action="store_true",
        help="only the tracing cost (off and on, side by side); writes results/tracing.json",
    )
    p.add_argument("--no-tracing", action="store_true", help="leave the tracing cost run out")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    s = Settings()
    if args.quick:
        s = Settings(
            rounds=1,
            ttft_samples=60,
            long_chunks=5000,
            concurrency=[(50, 100), (200, 20)],
            open_streams=[200, 1000],
            rates=[100.0, 500.0],
            rate_seconds=2.0,
            disconnect_samples=10,
            paced=[(200, 5.0, 6.0)],
            budget_s=90.0,
        )
    for name in (
        "rounds",
        "clients",
        "ttft_samples",
        "long_chunks",
        "concurrency",
        "open_streams",
        "rates",
        "rate_seconds",
        "paced",
        "paced_seconds",
        "budget_s",
    ):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    if args.disconnects is not None:
        s.disconnect_samples = args.disconnects
    s.paced = [(c, r, sec or s.paced_seconds) for c, r, sec in s.paced]
    s.clients = max(1, s.clients)
    s.rounds = max(1, s.rounds)
    return s


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": None,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "versions": {},
        "git": None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    for name in PACKAGES:
        try:
            info["versions"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info["versions"][name] = None
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "edge"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
        info["git"] = f"{head}{' + uncommitted changes in edge/' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# --- summary ------------------------------------------------------------------------------


def summarize(raw: dict[str, Any], s: Settings) -> dict[str, Any]:
    rounds = raw["rounds"]
    out: dict[str, Any] = {
        "calibration_us": fold([{"v": r["calibration_us"]} for r in rounds]).get("v"),
        "ttft": fold([r["ttft"] for r in rounds]),
    }

    def streams(get: Any) -> dict[str, Any]:
        edge = [get(r)["edge"] for r in rounds]
        direct = [get(r)["direct"] for r in rounds]
        derived = [
            {
                "throughput_vs_direct": ratio(e["chunks_per_s"], d["chunks_per_s"]),
                "edge_cpu_in_calibration_units": ratio(
                    e["edge_cpu_us_per_chunk"], r["calibration_us"]
                ),
            }
            for e, d, r in zip(edge, direct, rounds, strict=True)
        ]
        return {"edge": fold(edge), "direct": fold(direct), "vs": fold(derived)}

    out["one_stream"] = streams(lambda r: r["one_stream"])
    out["concurrency"] = {
        f"{c}x{n}": streams(lambda r, k=f"{c}x{n}": r["concurrency"][k]) for c, n in s.concurrency
    }
    out["concurrency_keys"] = [[f"{c}x{n}", c] for c, n in s.concurrency]
    out["nonstream"] = {}
    for rps in s.rates:
        key = f"{rps:g}rps"
        edge = [r["nonstream"][key]["edge"] for r in rounds]
        direct = [r["nonstream"][key]["direct"] for r in rounds]
        added = [
            {
                "added_p50_ms": diff(e["p50_ms"], d["p50_ms"]),
                "added_p99_ms": diff(e["p99_ms"], d["p99_ms"]),
            }
            for e, d in zip(edge, direct, strict=True)
        ]
        out["nonstream"][key] = {"edge": fold(edge), "direct": fold(direct), **fold(added)}
    out["rate_keys"] = [[f"{r:g}rps", r] for r in s.rates]
    out["paced"] = {}
    for count, tps, _ in s.paced:
        key = f"{count}x{tps:g}"
        edge = [r["paced"][key]["edge"] for r in rounds]
        direct = [r["paced"][key]["direct"] for r in rounds]
        derived = [
            {
                "edge_cpu_in_calibration_units": ratio(
                    e.get("edge_cpu_us_per_chunk"), r["calibration_us"]
                ),
                "added_gap_p50_ms": diff(e.get("gap_p50_ms"), d.get("gap_p50_ms")),
                "added_gap_p99_ms": diff(e.get("gap_p99_ms"), d.get("gap_p99_ms")),
                "rate_vs_direct": ratio(e.get("window_chunks_per_s"), d.get("window_chunks_per_s")),
            }
            for e, d, r in zip(edge, direct, rounds, strict=True)
        ]
        out["paced"][key] = {"edge": fold(edge), "direct": fold(direct), "vs": fold(derived)}
    once = raw["once"]
    out["disconnect"] = once.get("disconnect")
    out["client_alone"] = once.get("client_alone")
    out["open_streams"] = once.get("open_streams", {})
    measured = [v for v in out["open_streams"].values() if "opened" in v]
    out["open_streams_first"] = measured[0] if measured else None
    out["open_streams_last"] = measured[-1] if measured else None
    return out


# --- printing -------------------------------------------------------------------------------


def saturated(folded: dict[str, Any]) -> bool:
    value = folded.get("saturated")
    return value is True or (isinstance(value, list) and True in value)


def main_rows(sm: dict[str, Any], s: Settings) -> list[list[str]]:
    """figure | through the edge | baseline (same run) | edge vs baseline."""
    rows: list[list[str]] = []
    t = sm["ttft"]
    rows.append(
        [
            "TTFT p50 (edge vs node client, interleaved)",
            fmt_range(t.get("edge_p50_ms"), " ms"),
            fmt_range(t.get("direct_p50_ms"), " ms"),
            "+" + fmt_range(t.get("added_p50_ms"), " ms"),
        ]
    )
    rows.append(
        [
            "TTFT p99",
            fmt_range(t.get("edge_p99_ms"), " ms"),
            fmt_range(t.get("direct_p99_ms"), " ms"),
            "+" + fmt_range(t.get("added_p99_ms"), " ms"),
        ]
    )
    cal = sm.get("calibration_us")

    def stream_rows(label: str, fig: dict[str, Any]) -> None:
        rows.append(
            [
                f"{label}: chunks/s",
                fmt_range(dig(fig, "edge", "chunks_per_s")),
                fmt_range(dig(fig, "direct", "chunks_per_s")),
                "x" + fmt_range(dig(fig, "vs", "throughput_vs_direct")),
            ]
        )
        cpu = med(dig(fig, "edge", "edge_cpu_us_per_chunk"))
        rows.append(
            [
                f"{label}: edge CPU per chunk",
                fmt_range(dig(fig, "edge", "edge_cpu_us_per_chunk"), " us"),
                f"calibration {fmt(med(cal), ' us')}",
                fmt_range(dig(fig, "vs", "edge_cpu_in_calibration_units"), " units")
                + (f"; one core ~{fmt(1e6 / cpu)} ch/s" if cpu else ""),
            ]
        )

    stream_rows(f"1 x {s.long_chunks}", sm["one_stream"])
    for c, n in s.concurrency:
        stream_rows(f"{c} x {n}", sm["concurrency"][f"{c}x{n}"])
    for count, tps, _ in s.paced:
        fig = (sm.get("paced") or {}).get(f"{count}x{tps:g}")
        if fig:
            paced_rows(rows, f"paced {count} x {tps:g} tok/s", fig, cal)
    for rps in s.rates:
        fig = sm["nonstream"][f"{rps:g}rps"]
        edge = fig["edge"]
        rows.append(
            [
                f"non-stream {rps:g} req/s: p50",
                fmt_range(edge.get("p50_ms"), " ms"),
                fmt_range(dig(fig, "direct", "p50_ms"), " ms"),
                "+" + fmt_range(fig.get("added_p50_ms"), " ms"),
            ]
        )
        rows.append(
            [
                f"non-stream {rps:g} req/s: p99",
                fmt_range(edge.get("p99_ms"), " ms"),
                fmt_range(dig(fig, "direct", "p99_ms"), " ms"),
                "+" + fmt_range(fig.get("added_p99_ms"), " ms"),
            ]
        )
        rows.append(
            [
                f"non-stream {rps:g} req/s: achieved, edge CPU/req",
                f"{fmt_range(edge.get('achieved_rps'), ' req/s')}, "
                f"{fmt_range(edge.get('edge_cpu_us_per_req'), ' us')}",
                fmt_range(dig(fig, "direct", "achieved_rps"), " req/s"),
                "SATURATED (latencies not comparable)" if saturated(edge) else "",
            ]
        )
    dc = sm.get("disconnect") or {}
    rows.append(
        [
            "disconnect -> CancelRun at node p50",
            fmt(dc.get("edge_p50_ms"), " ms"),
            fmt(dc.get("direct_p50_ms"), " ms"),
            "+" + fmt(dc.get("added_p50_ms"), " ms"),
        ]
    )
    rows.append(
        [
            "disconnect -> CancelRun at node p99",
            fmt(dc.get("edge_p99_ms"), " ms"),
            fmt(dc.get("direct_p99_ms"), " ms"),
            "",
        ]
    )
    for key, fig in (sm.get("open_streams") or {}).items():
        if "opened" not in fig:
            rows.append([f"{int(key):,} open streams", "skipped (time budget)", "", ""])
            continue
        rows.append(
            [
                f"{int(key):,} open streams: edge RSS per stream",
                fmt(fig["rss_kib_per_stream"], " KiB"),
                f"idle edge {fmt(fig['rss_before_mib'], ' MiB')}",
                f"total {fmt(fig['rss_with_streams_mib'], ' MiB')}",
            ]
        )
        ended = fig.get("all_ended_on_node_s")
        rows.append(
            [
                f"{int(key):,} open streams: disconnect all -> all ended on node",
                fmt(ended, " s") if ended is not None else "not within the bound",
                "",
                f"CancelRun <= 1 s: {fig['cancel_rpc_in_grace']}/{fig['opened']} "
                f"(p50 {fmt(fig['cancel_p50_ms'], ' ms')}), late {fig['cancel_rpc_late']}, "
                f"gave up {fig['cancel_rpc_gave_up']}",
            ]
        )
        rows.append(
            [
                f"{int(key):,} open streams: opening",
                f"{fmt(fig['opens_per_s'], ' /s')}, edge "
                f"{fmt(fig['edge_cpu_ms_per_open'], ' ms')} CPU each",
                "",
                f"{fig['opened']}/{fig['streams']} opened",
            ]
        )
    return rows


def paced_rows(rows: list[list[str]], label: str, fig: dict[str, Any], cal: Any) -> None:
    """The paced workload: rate, edge CPU per chunk, inter-chunk gaps vs the node client."""
    edge = fig["edge"]
    offered = med(edge.get("offered_chunks_per_s"))
    rows.append(
        [
            f"{label}: chunks/s in the window (offered {fmt(offered)}; window "
            f"{fmt_range(edge.get('window_s'), ' s')})",
            fmt_range(edge.get("window_chunks_per_s")),
            fmt_range(dig(fig, "direct", "window_chunks_per_s")),
            "x"
            + fmt_range(dig(fig, "vs", "rate_vs_direct"))
            + ("; SATURATED" if saturated(edge) else ""),
        ]
    )
    cpu = med(edge.get("edge_cpu_us_per_chunk"))
    rows.append(
        [
            f"{label}: edge CPU per chunk",
            fmt_range(edge.get("edge_cpu_us_per_chunk"), " us"),
            f"calibration {fmt(med(cal), ' us')}",
            fmt_range(dig(fig, "vs", "edge_cpu_in_calibration_units"), " units")
            + (f"; one core ~{fmt(1e6 / cpu)} ch/s" if cpu else ""),
        ]
    )
    for q in ("p50", "p99"):
        rows.append(
            [
                f"{label}: inter-chunk gap {q}",
                fmt_range(edge.get(f"gap_{q}_ms"), " ms"),
                fmt_range(dig(fig, "direct", f"gap_{q}_ms"), " ms"),
                "+" + fmt_range(dig(fig, "vs", f"added_gap_{q}_ms"), " ms"),
            ]
        )


def cpu_rows(sm: dict[str, Any], s: Settings) -> list[list[str]]:
    """CPU per chunk by process: the client and the node must not be the bottleneck."""
    rows: list[list[str]] = []
    figs = (
        [(f"1 x {s.long_chunks}", sm["one_stream"])]
        + [(f"{c} x {n}", sm["concurrency"][f"{c}x{n}"]) for c, n in s.concurrency]
        + [
            (f"paced {c} x {t:g} tok/s", sm["paced"][f"{c}x{t:g}"])
            for c, t, _ in s.paced
            if f"{c}x{t:g}" in (sm.get("paced") or {})
        ]
    )
    for label, fig in figs:
        rows.append(
            [
                label,
                fmt_range(dig(fig, "edge", "edge_cpu_us_per_chunk"), " us"),
                fmt_range(dig(fig, "edge", "node_cpu_us_per_chunk"), " us"),
                fmt_range(dig(fig, "edge", "client_cpu_us_per_chunk"), " us"),
                fmt_range(dig(fig, "edge", "frames_per_write")),
                fmt_range(dig(fig, "direct", "node_cpu_us_per_chunk"), " us"),
                fmt_range(dig(fig, "direct", "client_cpu_us_per_chunk"), " us"),
            ]
        )
    return rows


def client_alone_line(sm: dict[str, Any]) -> str:
    parts = [
        f"{key.split('_')[-1]}: {fmt(fig.get('chunks_per_s'))} ch/s at "
        f"{fmt(fig.get('client_cpu_us_per_chunk'), ' us')}/chunk"
        for key, fig in (sm.get("client_alone") or {}).items()
    ]
    return "load generator alone (replay server, the edge's own frames): " + "; ".join(parts)


def render(result: dict[str, Any]) -> str:
    s = Settings(**result["settings"])
    s.concurrency = [tuple(x) for x in s.concurrency]  # type: ignore[misc]
    s.paced = [tuple(x) for x in s.paced]  # type: ignore[misc]
    sm = result["summary"]
    m = result["machine"]
    lines = [
        "",
        f"iop-edge benchmarks ({'quick' if result['quick'] else 'full'}, "
        f"{len(result['raw']['rounds'])} round(s), {result['elapsed_s']:.0f} s)",
        f"machine: {m['cores']} cores ({m['cpu']}), Python {m['python']}, "
        f"load {m['loadavg_start']} -> {m.get('loadavg_end')}, git {m['git']}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v),
        "Medians over rounds (min..max). Baseline = the same run via the node client "
        "directly (edge.node.client.GrpcNodeClient), same machine, same minute.",
        "",
        table(["figure", "through the edge", "baseline", "edge vs baseline"], main_rows(sm, s)),
        "",
        "CPU per chunk by process (edge runs: edge, node, client; direct runs: node, client)",
        table(
            [
                "workload",
                "edge",
                "node",
                "client",
                "SSE frames/write",
                "node (direct)",
                "client (direct)",
            ],
            cpu_rows(sm, s),
        ),
        client_alone_line(sm),
        "",
        "Goals (issue 7)",
        table(["goal", "measured", "met"], goal_rows(sm)),
    ]
    peer = result.get("peers")
    if peer:
        lines += peer_lines(peer, sm, s)
    return "\n".join(lines)


def peer_lines(peer: dict[str, Any], sm: dict[str, Any], s: Settings) -> list[str]:
    from benchmarks.peer import peer_headers, peer_rows, same_mock_headers, same_mock_rows

    if "error" in peer:
        return ["", f"peer comparison failed: {peer['error']}"]
    versions = peer.get("versions") or {}
    lines = []
    same = same_mock_rows(peer)
    if same:
        lines += [
            "",
            "Same upstream, same client (the peer tool): iop-edge -> iop-node -> mock vs "
            f"LiteLLM ({peer.get('litellm_spec')}) and SMG ({versions.get('smg', 'not run')}) "
            f"-> mock (iop-node CPU {peer.get('iop_node_cpu_s')} s, not in the edge's CPU "
            "figures)",
            table(same_mock_headers(peer), same),
        ]
    rows = peer_rows(peer, sm, s)
    if rows:
        lines += [
            "",
            "The edge's own harness (the simulated node over gRPC) beside the peers on their "
            "mock (HTTP/SSE): different upstreams and clients, trends only",
            table(peer_headers(peer), rows),
        ]
    return lines


def peers(args: argparse.Namespace, settings: Settings, tmp: Path) -> dict[str, Any]:
    """The peer tool's run (LiteLLM, SMG and the edge on its mock), or {"error": ...}."""
    from benchmarks.peer import DEFAULT_TOOL, run_peer, smg_binary

    smg = None
    if not args.no_smg:
        try:
            smg = args.smg or smg_binary()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            return {"error": f"SMG could not be installed: {exc!r}"}
    print("running the peer tool (installs litellm on first use)...", file=sys.stderr)
    return run_peer(args.peer_tool or DEFAULT_TOOL, settings, args.quick, tmp, smg)


@contextmanager
def _workdir(prefix: str, keep: bool) -> Iterator[Path]:
    """A temporary directory for one bench command: removed after, unless `keep`."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    finally:
        if keep:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _write(out: Path, result: dict[str, Any], started: float) -> None:
    """The run's elapsed time into `result`, then `result` as JSON into `out`."""
    result["elapsed_s"] = sig(time.monotonic() - started)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")


def main_peers(args: argparse.Namespace, settings: Settings) -> int:
    """`--peers-only`: the peer tool's run alone; prints the same-upstream table."""
    from benchmarks.peer import same_mock_headers, same_mock_rows

    out = args.out or DEFAULT_OUT.parent / "peers.json"
    started = time.monotonic()
    with _workdir("iop-bench-peers-", args.keep) as tmp:
        result: dict[str, Any] = {"peers": peers(args, settings, tmp), "machine": machine()}
    _write(out, result, started)
    peer = result["peers"]
    if "error" in peer:
        print(f"peer comparison failed: {peer['error']}")
        return 1
    print(
        f"Same upstream, same client (peer tool, {result['elapsed_s']:.0f} s): "
        f"LiteLLM {peer.get('litellm_spec')}, SMG {(peer.get('versions') or {}).get('smg')}; "
        f"iop-node CPU {peer.get('iop_node_cpu_s')} s is not in the edge's figures"
    )
    print(table(same_mock_headers(peer), same_mock_rows(peer)))
    print(f"\nwritten: {out}")
    return 0


def main_ab(args: argparse.Namespace, settings: Settings) -> int:
    """`--ab REV`: this tree against REV, alternating; prints the table, writes ab.json."""
    from benchmarks.ab import render_ab, run_ab

    out = args.out or DEFAULT_OUT.parent / "ab.json"
    started = time.monotonic()
    with _workdir("iop-bench-ab-", args.keep) as tmp:
        result = run_ab(args.ab, settings, max(1, args.ab_pairs), tmp)
    result["machine"] = machine()
    _write(out, result, started)
    print(render_ab(result))
    print(f"\nwritten: {out}")
    return 0


def overload_settings(args: argparse.Namespace) -> OverloadSettings:
    return OVERLOAD_QUICK if args.quick else OverloadSettings()


def overload_run(
    args: argparse.Namespace, tmp: Path, source: EdgeSource | None = None
) -> dict[str, Any]:
    """The overload curve on a stack of its own, with one load-generator process."""
    pool = Pool(1)
    where = tmp / f"overload-{source.label if source else 'tree'}".replace(" ", "_")
    where.mkdir(parents=True, exist_ok=True)
    try:
        return measure_overload(
            pool, where, overload_settings(args), source,
            log=lambda text: print(text, file=sys.stderr, flush=True),
        )  # fmt: skip
    finally:
        pool.close()


def main_overload(args: argparse.Namespace) -> int:
    """`--overload-only`: the curve (and REV's, with `--ab REV`); writes overload.json."""
    from benchmarks.ab import checkout, edge_module_path, remove_checkout, tree_label

    out = args.out or DEFAULT_OUT.parent / "overload.json"
    result: dict[str, Any] = {"machine": machine(), "quick": args.quick, "curves": {}}
    started = time.monotonic()
    with _workdir("iop-bench-overload-", args.keep) as tmp:
        result["curves"][tree_label()] = overload_run(args, tmp)
        if args.ab:
            _, where, other = checkout(args.ab, tmp)
            try:
                result["edge_code"] = edge_module_path(other)
                result["curves"][other.label] = overload_run(args, tmp, other)
            finally:
                remove_checkout(where)
    _write(out, result, started)
    for label, curve in result["curves"].items():
        print("\n".join(render_overload(curve, label)) + "\n")
    print(f"written: {out}")
    return 0


def workers_run(args: argparse.Namespace, tmp: Path, clients: int) -> dict[str, Any]:
    """Throughput by worker count, on stacks of its own, with `clients` load generators."""
    from benchmarks.workers import QUICK, WorkerSettings, measure_workers

    pool = Pool(clients)
    try:
        return measure_workers(pool, tmp, QUICK if args.quick else WorkerSettings())
    finally:
        pool.close()


def main_workers(args: argparse.Namespace, settings: Settings) -> int:
    """`--workers-only`: throughput by worker count; writes workers.json."""
    from benchmarks.workers import render_workers

    return _only(args, settings, "workers", workers_run, render_workers)


def _only(
    args: argparse.Namespace,
    settings: Settings,
    name: str,
    run: Callable[[argparse.Namespace, Path, int], dict[str, Any]],
    render: Callable[[dict[str, Any]], list[str]],
) -> int:
    """One workload alone (`--NAME-only`): run it, write NAME.json, print its table."""
    out = args.out or DEFAULT_OUT.parent / f"{name}.json"
    started = time.monotonic()
    with _workdir(f"iop-bench-{name}-", args.keep) as tmp:
        result: dict[str, Any] = {"machine": machine(), "quick": args.quick}
        result[name] = run(args, tmp, settings.clients)
        result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    _write(out, result, started)
    print("\n".join(render(result[name])))
    print(f"\nwritten: {out}")
    return 0


def tracing_run(args: argparse.Namespace, tmp: Path, clients: int) -> dict[str, Any]:
    """The tracing cost, on stacks of its own, with `clients` load generators."""
    from benchmarks.tracing import QUICK, TracingSettings, measure_tracing

    pool = Pool(clients)
    try:
        return measure_tracing(pool, tmp, QUICK if args.quick else TracingSettings())
    finally:
        pool.close()


def main_tracing(args: argparse.Namespace, settings: Settings) -> int:
    """`--tracing-only`: the tracing cost; writes tracing.json."""
    from benchmarks.tracing import render_tracing

    return _only(args, settings, "tracing", tracing_run, render_tracing)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_from(args)
    nofile = raise_nofile()
    need = max(settings.open_streams, default=0) + 512
    if nofile < need:
        print(
            f"benchmarks: RLIMIT_NOFILE is {nofile}; {need} are needed for "
            f"{max(settings.open_streams):,} open streams (raise `ulimit -Hn`)",
            file=sys.stderr,
        )
        return 2
    if args.overload_only:
        return main_overload(args)
    if args.workers_only:
        return main_workers(args, settings)
    if args.tracing_only:
        return main_tracing(args, settings)
    if args.ab:
        return main_ab(args, settings)
    if args.peers_only:
        return main_peers(args, settings)
    args.out = args.out or DEFAULT_OUT
    info = machine()
    started = time.monotonic()
    result: dict[str, Any] = {
        "tool": "iop-edge benchmarks",
        "quick": args.quick,
        "settings": settings.__dict__,
        "machine": info,
    }
    with _workdir("iop-bench-", args.keep) as tmp:
        raw = run(settings, tmp)
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        result["raw"] = raw
        result["summary"] = summarize(raw, settings)
        result["goals"] = goal_rows(result["summary"])
        if not args.no_overload:
            result["overload"] = overload_run(args, tmp)
        if not args.no_workers:
            result["workers"] = workers_run(args, tmp, settings.clients)
        if not args.no_tracing:
            result["tracing"] = tracing_run(args, tmp, settings.clients)
        if args.peers or args.litellm:
            result["peers"] = peers(args, settings, tmp)
    _write(args.out, result, started)
    print(render(result))
    if "overload" in result:
        print("\n" + "\n".join(render_overload(result["overload"])))
    if "workers" in result:
        from benchmarks.workers import render_workers

        print("\n" + "\n".join(render_workers(result["workers"])))
    if "tracing" in result:
        from benchmarks.tracing import render_tracing

        print("\n" + "\n".join(render_tracing(result["tracing"])))
    print(f"\nwritten: {args.out}")
    return 0
