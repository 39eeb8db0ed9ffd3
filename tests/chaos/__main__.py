"""`python -m tests.chaos`: one seeded chaos run; exits 1 if any invariant broke.

    make chaos CHAOS_ARGS="--seed 1234 --streams 400"

Prints a summary table; on failure, every broken invariant with the request
and run ids involved, the command that replays the seed, and the directory
holding the edge's log and the nodes' runs logs. A SIGTERM or SIGINT stops the
run: its processes, then its directory (`benchmarks.cleanup`).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.cleanup import run_program, run_trio
from tests.chaos.procs import ProcessError
from tests.chaos.report import Options, summary
from tests.chaos.suite import run_suite


def build_parser() -> argparse.ArgumentParser:
    d = Options()
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=d.seed, help=f"scenario seed (default {d.seed})")
    p.add_argument(
        "--streams", type=int, default=d.streams, help=f"streams to run (default {d.streams})"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=d.concurrency,
        help=f"streams at once (default {d.concurrency})",
    )
    p.add_argument(
        "--nodes", type=int, default=d.nodes, help=f"iop-sim-node processes (default {d.nodes})"
    )
    p.add_argument(
        "--node-kills",
        type=int,
        default=d.node_kills,
        help=f"kill -9 + restarts (default {d.node_kills})",
    )
    p.add_argument(
        "--rate", type=float, default=d.rate, help=f"new streams a second (default {d.rate:g})"
    )
    p.add_argument(
        "--duration", type=float, default=d.duration, help="bound on the load phase, seconds"
    )
    p.add_argument(
        "--rss-bound-mib", type=float, default=d.rss_bound_mib, help="allowed RSS growth"
    )
    p.add_argument(
        "--idle-close",
        type=int,
        default=d.idle_close,
        help=f"keep-alive clients that close while idle (default {d.idle_close})",
    )
    p.add_argument(
        "--no-migration",
        action="store_true",
        help="no mid-answer kills: the edge runs with [routing] migrations = 0, and a stream "
        "a node kill meets after its first byte may end in an error frame",
    )
    p.add_argument(
        "--migrations",
        type=int,
        default=d.migrations,
        help="the edge's [routing] migrations: how often one answer may move "
        f"(default {d.migrations}: the kills here come seconds apart)",
    )
    p.add_argument(
        "--keep-logs", action="store_true", help="keep the work dir (always kept on failure)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    counts = (args.streams, args.node_kills, args.idle_close, args.migrations)
    if min(counts) < 0 or min(args.concurrency, args.nodes) < 1 or args.rate <= 0:
        print("chaos: counts >= 0, --concurrency and --nodes >= 1, --rate > 0", file=sys.stderr)
        return 2
    options = Options(
        seed=args.seed,
        streams=args.streams,
        concurrency=args.concurrency,
        nodes=args.nodes,
        node_kills=args.node_kills,
        duration=args.duration,
        rss_bound_mib=args.rss_bound_mib,
        keep_logs=args.keep_logs,
        idle_close=args.idle_close,
        rate=args.rate,
        migration=not args.no_migration and args.migrations > 0,
        migrations=0 if args.no_migration else args.migrations,
    )
    try:
        report = run_trio(run_suite, options)
    except ProcessError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        print(f"replay: {options.replay()}", file=sys.stderr)
        return 2
    print(summary(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(run_program(main, "chaos"))
