"""Profile the edge (or the node) with py-spy while a benchmark workload runs.

    python -m benchmarks.profile_edge [--workload one|conc|nonstream|paced] [--runs N]
                                      [--target edge|node] [--top N] [--raw FILE]

Starts the same stack as `make bench`, warms it up, attaches `py-spy record` (raw
collapsed stacks) to the target process, runs the workload `--runs` times, and prints
the hottest functions by self time and by inclusive time, and self time by package.
py-spy is not a project dependency: `.venv/bin/pip install py-spy` first (do not add
it to pyproject.toml). py-spy samples wall time of the running thread, so time inside
syscalls is included (and inflated when the machine is oversubscribed).
"""

from __future__ import annotations

import argparse
import collections
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import paced
from benchmarks.cleanup import child_options, remove_dir, run_program, temp_dir
from benchmarks.harness import Bench, Settings
from benchmarks.loadgen import Pool
from benchmarks.stack import Stack

_LINE = re.compile(r":\d+\)$")


def _package(frame: str) -> str:
    match = re.search(r"\((.*?)\)$", frame)
    path = match.group(1) if match else frame
    if path.startswith("edge/"):
        return "/".join(path.split("/")[:2])
    return path.split("/")[0]


def summarize(raw: Path, top: int) -> str:
    """Self and inclusive shares per function (line numbers folded), self per package."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    pkg: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [
            _LINE.sub(")", f) for f in stack.split(";") if not f.startswith(("process ", "thread "))
        ]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        pkg[_package(frames[-1])] += n
        for frame in set(frames):
            incl[frame] += n
    if not total:
        return "no samples"
    out = [f"{total} samples"]
    for title, counter, k in (
        ("self time by package", pkg, 15),
        ("self time", own, top),
        ("inclusive time", incl, top),
    ):
        out.append(f"--- {title}")
        out += [f"{100 * n / total:5.1f}%  {name}" for name, n in counter.most_common(k)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_edge", description=__doc__)
    parser.add_argument("--workload", choices=["one", "conc", "nonstream", "paced"], default="one")
    parser.add_argument(
        "--paced", default="1000x1x14", help="paced streams COUNTxTOKENS_PER_SxSECONDS"
    )
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=20_000, help="deltas per one-stream run")
    parser.add_argument("--target", choices=["edge", "node"], default="edge")
    parser.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--raw", type=Path, default=None, help="keep the collapsed stacks here")
    parser.add_argument(
        "--blocking",
        action="store_true",
        help="pause the target for each sample (whole stacks; slows the target a little)",
    )
    args = parser.parse_args(argv)
    spy_bin = Path(sys.executable).parent / "py-spy"
    if not spy_bin.exists():
        print("py-spy is not installed: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    tmp = temp_dir("iop-profile-")
    raw = args.raw or tmp / "profile.raw"
    try:
        with Stack(tmp) as stack:
            pool = Pool(1)
            try:
                bench = Bench(stack, pool, Settings(clients=1, budget_s=3600))
                bench.warm_up()
                pid = bench.edge.pid if args.target == "edge" else bench.node.pid
                cmd = [str(spy_bin), "record", "--pid", str(pid), "--rate", str(args.rate)]
                cmd += ["--format", "raw", "--output", str(raw)]
                if not args.blocking:
                    cmd.append("--nonblocking")
                spy = subprocess.Popen(
                    cmd,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    **child_options(),
                )
                try:
                    time.sleep(1.0)
                    for _ in range(max(1, args.runs)):
                        if args.workload == "one":
                            result = bench.streams("edge", 1, args.chunks, 120.0)
                        elif args.workload == "conc":
                            result = bench.streams("edge", 100, 200, 120.0)
                        elif args.workload == "paced":
                            count, tps, seconds = args.paced.split("x")
                            result = paced.measure(
                                bench, "edge", int(count), float(tps), float(seconds)
                            )
                        else:
                            result = bench.rate("edge", 100.0, 3.0)
                        keys = (
                            "chunks_per_s",
                            "window_chunks_per_s",
                            "edge_cpu_us_per_chunk",
                            "edge_cpu_us_per_req",
                        )
                        print({k: result[k] for k in keys if k in result}, file=sys.stderr)
                        bench.settle()
                finally:
                    spy.send_signal(signal.SIGINT)
                    try:
                        spy.wait(30)
                    except subprocess.TimeoutExpired:
                        spy.kill()
                        spy.wait(5)
            finally:
                pool.close()
        print(summarize(raw, args.top))
    finally:
        remove_dir(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(run_program(main, "benchmarks.profile_edge"))
