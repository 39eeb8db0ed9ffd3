# The command line of `python -m benchmarks`: the flags, and the `Settings` they fill.
# The docstring below is the `--help` text. This module must not know how a run is
# measured, printed or written (`benchmarks.cli`).
"""`make bench` / `python -m benchmarks`: measure the edge, print a table, write JSON.

Flags: `--quick` (a ~1 minute smoke run with smaller sizes), `--rounds N`, `--clients N`
(load-generator processes), sizes (`--ttft-samples`, `--long-chunks`, `--concurrency`,
`--open-streams`, `--rates`, `--rate-seconds`, `--disconnects`), `--budget-s`, `--out`,
`--keep` (keep the temporary directory with the edge's and the node's logs), `--paced`
(the paced workload's sizes), `--overload-only` / `--no-overload` (the overload curve,
`benchmarks.overload`; with `--ab REV` the curve on both sides), `--peers` (also run
the peer tool with LiteLLM and SMG; it installs both into ~/.cache) and `--ab REV`
(A/B against a git revision; `--ab main --quick`: the headline A/B in a few minutes),
`--all` (the long sections too: worker counts, tracing, node hop, control plane, DNS
discovery; by
default `make bench` is the main workloads and the overload curve),
`--workers-only` / `--no-workers` (throughput by worker
count, `benchmarks.workers`), `--node-hop-only` / `--no-node-hop` (plaintext and a
locked node hop side by side, `benchmarks.nodehop`), `--tracing-only` / `--no-tracing`
(the edge's CPU per request and per chunk with tracing off and on, `benchmarks.tracing`),
`--control-plane-only` / `--no-control-plane` (the edge's CPU per node to know its
nodes' state, Watch against Describe polling, `benchmarks.controlplane`),
`--discovery-only` / `--no-discovery` (an idle edge's CPU with 100 nodes found by DNS
against a static list of them, `benchmarks.discovery`), `--fleet`
(routing policies over four simulated nodes with a KV cache, `benchmarks.fleet`; with
`--peers`, or whenever the pinned SMG is installed, SMG beside the edge on four HTTP
workers, `benchmarks.fleetpeer`; and the cache-pressure workload, `benchmarks.pressure`;
writes results/fleet.json; `--fleet-only NAMES` the same for some workloads only),
`--tenants` (fair share
when the fleet is full: tenants, weights and service tiers beside a flood, the fair
and FIFO admission policies side by side, `benchmarks.tenants`; writes
results/tenants.json), `--calls` (the edge's function calls per request, counted by
cProfile: exact, no calibration; with `--ab REV` both trees and the functions whose
counts differ most, `benchmarks.calls`; writes results/calls.json).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.harness import Settings


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
        "--all",
        action="store_true",
        help="also the long sections after the main workloads and the overload curve:"
        " worker counts, tracing, the node hop, the control plane, DNS discovery (~+13 min)",
    )
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
    p.add_argument(
        "--node-hop-only",
        action="store_true",
        help="only the node hop's cost (plaintext and mutual TLS + token, side by side);"
        " writes results/node_hop.json",
    )
    p.add_argument("--no-node-hop", action="store_true", help="leave the node hop's cost out")
    p.add_argument(
        "--control-plane-only",
        action="store_true",
        help="only the control-plane cost (Watch against Describe polling, N = 10, 100, 300 "
        "nodes); writes results/control-plane.json",
    )
    p.add_argument(
        "--no-control-plane", action="store_true", help="leave the control-plane cost run out"
    )
    p.add_argument(
        "--discovery-only",
        action="store_true",
        help="only the cost of nodes found by DNS (an idle edge's CPU, 100 nodes behind one"
        " SRV name looked up every 5 s and 0.1 s, against a static list); writes"
        " results/discovery.json",
    )
    p.add_argument(
        "--no-discovery", action="store_true", help="leave the DNS discovery cost run out"
    )
    p.add_argument(
        "--fleet",
        action="store_true",
        help="only the routing policies over 4 simulated nodes with a KV cache (five "
        "workloads, cache pressure among them; two edges; with --peers or an installed SMG, "
        "SMG beside the edge); writes results/fleet.json",
    )
    p.add_argument(
        "--fleet-only",
        metavar="NAMES",
        type=lambda text: tuple(x.strip() for x in text.split(",") if x.strip()),
        default=None,
        help="--fleet with these workloads only, comma-separated: shared, sessions, hot, "
        "random, pressure (the cache-pressure workload: ~7 minutes with SMG)",
    )
    p.add_argument(
        "--tenants",
        action="store_true",
        help="only fair share when the fleet is full (tenants, weights, service tiers beside "
        "a flood; the fair and fifo admission policies side by side, then 2 workers); "
        "writes results/tenants.json",
    )
    _call_flags(p)
    return p


def _call_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--calls",
        action="store_true",
        help="only the edge's function calls per request, counted by cProfile (exact; with "
        "--ab REV: both trees, and the functions whose counts differ most); writes "
        "results/calls.json",
    )
    p.add_argument(
        "--calls-requests",
        type=_ints,
        default=[200, 1200],
        metavar="SMALL,LARGE",
        help="requests of the two runs per workload whose difference is counted (200,1200)",
    )
    p.add_argument(
        "--calls-warmup", type=int, default=100, help="warm-up requests of each run (100)"
    )
    p.add_argument(
        "--calls-workloads",
        default="nonstream,stream20,stream200",
        help="nonstream and streamN (N chunks), comma-separated (nonstream,stream20,stream200)",
    )
    p.add_argument(
        "--calls-top", type=int, default=15, help="functions listed by --calls --ab (15)"
    )


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
