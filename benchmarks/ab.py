"""`--ab REV`: the headline workloads, this tree against git revision REV, alternating.

REV is checked out with `git worktree add --detach` into the run's temporary directory
(removed at the end). When each of its `[project] dependencies` is one of this
tree's (the same pin), its edge runs on this venv with the checkout alone on
PYTHONPATH; otherwise a venv of its own is built in the temporary directory (`pip
install`, bounded), and its edge runs with no PYTHONPATH (an inherited one would put
this tree's code first). Only the edge process
changes sides: the simulated node and the load generator (with its direct baseline
through `edge.node.client`) are this tree's in every run, so both sides face the same
upstream and the same client.

Runs alternate A/B/A/B (A = this tree, B = REV), each a fresh stack, one round of the
headline workloads (TTFT, one stream, the concurrency cases, non-stream at the lowest
rate, the paced streams). Each headline figure is divided by the CPU yardstick
(`benchmarks.calibrate`) measured in the same run: "calibration units" compare across
runs when the machine's speed drifts. The verdict per figure: "same" when the two
medians differ by no more than the larger of the two sides' run-to-run ranges. Beside it,
an exact permutation p-value of the difference of medians: with 3 pairs a verdict
"beyond the spread" also comes from noise alone (~10% of figures when both sides run the
same code on a busy machine), so re-run a flagged figure with more pairs.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import Bench, Settings
from benchmarks.loadgen import Pool
from benchmarks.report import diff, dig, fmt, ratio, sig, table
from benchmarks.stack import EdgeSource, Stack
from benchmarks.workloads import measure_round

ROOT = Path(__file__).resolve().parent.parent
VENV_TIMEOUT_S = 15 * 60
Getter = Callable[[dict[str, Any]], float | None]


def tree_label() -> str:
    """The working tree's name in results: its commit, and whether edge/ has changes."""
    changed = " + changes" if _git("status", "--porcelain", "--", "edge") else ""
    return f"this tree ({_git('rev-parse', '--short', 'HEAD')}{changed})"


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def _dependencies(pyproject: str) -> list[str]:
    return sorted(tomllib.loads(pyproject).get("project", {}).get("dependencies", []))


def shares_venv(ours: str, theirs: str) -> bool:
    """Whether a revision whose pyproject.toml is `theirs` runs on the venv of `ours`:
    each of its `[project] dependencies` is one of ours, pinned alike."""
    return set(_dependencies(theirs)) <= set(_dependencies(ours))


def checkout(rev: str, tmp: Path) -> tuple[str, Path, EdgeSource]:
    """`git worktree add` REV under tmp; how to run its edge (PYTHONPATH or its own venv)."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    where = tmp / "rev"
    _git("worktree", "add", "--detach", str(where), sha)
    try:
        return sha, where, _source(rev, sha, where, tmp)
    except BaseException:  # stopped while its venv was built: no worktree is left behind
        remove_checkout(where)
        raise


def _source(rev: str, sha: str, where: Path, tmp: Path) -> EdgeSource:
    """How to run the edge of the checkout at `where`: on this venv, or one of its own."""
    label = f"{rev} ({sha[:10]})"
    ours = (ROOT / "pyproject.toml").read_text()
    if shares_venv(ours, (where / "pyproject.toml").read_text()):
        return EdgeSource(label=label, env=(("PYTHONPATH", str(where)),))
    venv = tmp / "rev-venv"
    print(f"{rev}: other dependencies; building a venv for it in {venv}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
         "--disable-pip-version-check", str(where)],
        check=True, timeout=VENV_TIMEOUT_S,
    )  # fmt: skip
    return EdgeSource(
        label=label, command=(str(venv / "bin" / "iop-edge"),), env=(("PYTHONPATH", ""),)
    )


def remove_checkout(where: Path) -> None:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip


def edge_module_path(source: EdgeSource) -> str:
    """Where the edge of `source` imports `edge` from (proves which code runs)."""
    command = source.command
    python = str(Path(command[0]).parent / "python") if command else sys.executable
    done = subprocess.run(
        [python, "-c", "import edge; print(edge.__file__)"],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, **dict(source.env)}, cwd=Path(tempfile.gettempdir()),
    )  # fmt: skip
    return done.stdout.strip()


def ab_settings(s: Settings) -> Settings:
    """The headline workloads only: one round per run, the lowest non-stream rate."""
    return Settings(
        rounds=1,
        clients=s.clients,
        ttft_samples=s.ttft_samples,
        long_chunks=s.long_chunks,
        concurrency=list(s.concurrency),
        open_streams=[],
        rates=[min(s.rates)] if s.rates else [],
        rate_seconds=s.rate_seconds,
        disconnect_samples=0,
        budget_s=1e9,
        paced=list(s.paced),
        paced_seconds=s.paced_seconds,
    )


def at(*path: str) -> Getter:
    """The figure at `path` of a round."""

    def get(r: dict[str, Any]) -> float | None:
        value = dig(r, *path)
        return float(value) if isinstance(value, int | float) else None

    return get


def added_ms(edge: Getter, direct: Getter) -> Getter:
    """Edge minus direct, milliseconds -> microseconds (to divide by the calibration)."""

    def get(r: dict[str, Any]) -> float | None:
        added = diff(edge(r), direct(r))
        return None if added is None else added * 1e3

    return get


def ratio_of(a: Getter, b: Getter) -> Getter:
    return lambda r: ratio(a(r), b(r))


def headlines(s: Settings) -> list[tuple[str, str, Getter]]:
    """(label, kind, getter): kind "us" is divided by the calibration, "x" is a ratio."""
    out: list[tuple[str, str, Getter]] = [
        ("TTFT added p50", "us", added_ms(at("ttft", "edge_p50_ms"), at("ttft", "direct_p50_ms"))),
        ("TTFT added p99", "us", added_ms(at("ttft", "edge_p99_ms"), at("ttft", "direct_p99_ms"))),
        (
            f"1 x {s.long_chunks}: edge CPU per chunk",
            "us",
            at("one_stream", "edge", "edge_cpu_us_per_chunk"),
        ),
        (
            f"1 x {s.long_chunks}: chunks/s vs direct",
            "x",
            ratio_of(
                at("one_stream", "edge", "chunks_per_s"), at("one_stream", "direct", "chunks_per_s")
            ),
        ),
    ]
    for c, n in s.concurrency:
        k = f"{c}x{n}"
        out.append(
            (
                f"{c} x {n}: edge CPU per chunk",
                "us",
                at("concurrency", k, "edge", "edge_cpu_us_per_chunk"),
            )
        )
    for rps in s.rates:
        k = f"{rps:g}rps"
        out.append(
            (
                f"non-stream {rps:g} req/s: edge CPU per request",
                "us",
                at("nonstream", k, "edge", "edge_cpu_us_per_req"),
            )
        )
        out.append(
            (
                f"non-stream {rps:g} req/s: added p99",
                "us",
                added_ms(
                    at("nonstream", k, "edge", "p99_ms"), at("nonstream", k, "direct", "p99_ms")
                ),
            )
        )
    for c, t, _ in s.paced:
        k = f"{c}x{t:g}"
        out.append(
            (
                f"paced {c} x {t:g} tok/s: edge CPU per chunk",
                "us",
                at("paced", k, "edge", "edge_cpu_us_per_chunk"),
            )
        )
        out.append(
            (
                f"paced {c} x {t:g} tok/s: added inter-chunk gap p99",
                "us",
                added_ms(
                    at("paced", k, "edge", "gap_p99_ms"), at("paced", k, "direct", "gap_p99_ms")
                ),
            )
        )
    return out


def run_ab(rev: str, settings: Settings, pairs: int, tmp: Path) -> dict[str, Any]:
    """Alternate this tree (A) and REV (B), `pairs` times each; the raw rounds and a summary."""
    s = ab_settings(settings)
    tree = EdgeSource(label=tree_label())
    sha, where, other = checkout(rev, tmp)
    out: dict[str, Any] = {"rev": rev, "sha": sha, "settings": s.__dict__, "runs": []}
    try:
        out["edge_code"] = {"A": edge_module_path(tree), "B": edge_module_path(other)}
        out["labels"] = {"A": tree.label, "B": other.label}
        pool = Pool(s.clients)
        try:
            for i in range(2 * pairs):
                side, source = ("A", tree) if i % 2 == 0 else ("B", other)
                run_dir = tmp / f"run{i}-{side}"
                run_dir.mkdir()
                started = time.monotonic()
                with Stack(run_dir, source) as stack:
                    bench = Bench(stack, pool, s)
                    bench.log(f"A/B run {i + 1}/{2 * pairs}: {side} = {source.label}")
                    bench.warm_up()
                    r = measure_round(bench, i // 2)
                r["side"] = side
                r["elapsed_s"] = sig(time.monotonic() - started)
                out["runs"].append(r)
        finally:
            pool.close()
    finally:
        remove_checkout(where)
    out["summary"] = summarize_ab(out["runs"], s)
    return out


def summarize_ab(runs: list[dict[str, Any]], s: Settings) -> list[dict[str, Any]]:
    rows = []
    for label, kind, get in headlines(s):
        sides: dict[str, list[float]] = {"A": [], "B": []}
        raw: dict[str, list[float]] = {"A": [], "B": []}
        for r in runs:
            value = get(r)
            if value is None:
                continue
            raw[r["side"]].append(value)
            if kind == "us":
                value = value / r["calibration_us"]
            sides[r["side"]].append(value)
        row: dict[str, Any] = {
            "figure": label,
            "kind": kind,
            "A": sides["A"],
            "B": sides["B"],
            "A_raw": raw["A"],
            "B_raw": raw["B"],
        }
        if sides["A"] and sides["B"]:
            a, b = _median(sides["A"]), _median(sides["B"])
            spread = max(max(v) - min(v) for v in sides.values())
            row.update(
                {
                    "A_med": a,
                    "B_med": b,
                    "A_minus_B": a - b,
                    "A_vs_B": a / b if b else None,
                    "raw_A_vs_B": _median(raw["A"]) / _median(raw["B"])
                    if _median(raw["B"])
                    else None,
                    "spread": spread,
                    "p": permutation_p(sides["A"], sides["B"]),
                }
            )
            higher_is_better = kind == "x"
            if min(len(v) for v in sides.values()) < 2:
                row["verdict"] = "no spread (one run per side)"
            elif abs(a - b) <= spread:
                row["verdict"] = "same (within the spread)"
            elif (a > b) != higher_is_better:
                row["verdict"] = "A WORSE beyond the spread"
            else:
                row["verdict"] = "A better beyond the spread"
        rows.append(row)
    return rows


def permutation_p(a: list[float], b: list[float]) -> float:
    """Exact two-sided permutation p-value of the difference of medians.

    Every split of the pooled runs into two groups of the same sizes counts; with 3 runs
    a side the smallest p is 0.20 (medians tie across splits), with 5 it is 0.048. It
    says how often a gap this wide comes from shuffling the same runs: a hint, beside
    the spread.
    """
    pooled = a + b
    observed = abs(_median(a) - _median(b))
    hits = total = 0
    for chosen in itertools.combinations(range(len(pooled)), len(a)):
        picked = set(chosen)
        x = [pooled[i] for i in chosen]
        y = [v for i, v in enumerate(pooled) if i not in picked]
        total += 1
        hits += abs(_median(x) - _median(y)) >= observed - 1e-12
    return hits / total


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def render_ab(result: dict[str, Any]) -> str:
    labels = result["labels"]
    cal = [r["calibration_us"] for r in result["runs"]]
    lines = [
        "",
        f"A/B in one sitting ({len(result['runs'])} runs alternating A/B, "
        f"{result.get('elapsed_s', 0):.0f} s): A = {labels['A']}, B = {labels['B']}",
        f"edge code: A imports {result['edge_code']['A']}, B imports {result['edge_code']['B']}",
        f"calibration per run: {', '.join(fmt(c, ' us') for c in cal)}",
        "Figures in calibration units (us / the run's calibration us; 'x' = a ratio): "
        "median (min..max over the runs of each side); 'raw A vs B' compares the medians "
        "in us, without the calibration.",
        "",
    ]
    rows = []
    for row in result["summary"]:
        if "A_med" not in row:
            rows.append([row["figure"], "-", "-", "-", "-", "-", "-", "no data"])
            continue
        unit = "" if row["kind"] == "x" else " u"
        rows.append(
            [
                row["figure"],
                f"{fmt(row['A_med'], unit)} ({fmt(min(row['A']))}..{fmt(max(row['A']))})",
                f"{fmt(row['B_med'], unit)} ({fmt(min(row['B']))}..{fmt(max(row['B']))})",
                f"{(row['A_vs_B'] - 1) * 100:+.1f}%" if row["A_vs_B"] else "-",
                f"{(row['raw_A_vs_B'] - 1) * 100:+.1f}%" if row.get("raw_A_vs_B") else "-",
                fmt(row["spread"], unit),
                f"{row['p']:.2f}",
                row["verdict"],
            ]
        )
    headers = ["figure", "A", "B", "A vs B", "raw A vs B", "spread", "p", "verdict"]
    lines.append(table(headers, rows))
    return "\n".join(lines)
