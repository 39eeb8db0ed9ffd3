"""A chaos run's options and report: the summary table and the per-request record.

`Options` are the knobs (and the replay command that repeats them);
`Report` is what a run found; `summary` renders it for a terminal, and
`write_results` leaves one JSON line per request for a post-mortem.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos.checks import INVARIANTS, Violation, histogram_quantile, quantile
from tests.chaos.client import StreamResult
from tests.chaos.plan import KINDS
from tests.chaos.procs import Stats
from tests.chaos.witness import client_view


@dataclass(frozen=True, slots=True)
class Options:
    seed: int = 1234
    streams: int = 500
    concurrency: int = 200
    nodes: int = 3
    node_kills: int = 3
    duration: float = 150.0
    rss_bound_mib: float = 50.0
    keep_logs: bool = False
    idle_close: int = 20
    # New streams per second at most: a burst of hundreds of new requests at
    # once measures the edge's capacity, not its invariants.
    rate: float = 120.0
    # Mid-answer kills: a stream a node kill meets after its first byte must complete
    # whole (the edge moves it to another node). False: the edge runs with
    # `[routing] migrations = 0` and such a stream may end in an error frame.
    migration: bool = True
    # The edge's `[routing] migrations` when on. The kills here come a second or two
    # apart on three nodes, far more often than a fleet's restarts, so one long answer
    # often meets two or three of them; the edge's own default (1) is held to its
    # rule in tests/integration (test_migration_e2e.py).
    migrations: int = 3

    def replay(self) -> str:
        """The one command that runs this same scenario again."""
        args = (
            f"--seed {self.seed} --streams {self.streams} --concurrency {self.concurrency} "
            f"--nodes {self.nodes} --node-kills {self.node_kills} --idle-close {self.idle_close}"
        )
        default = Options()
        if self.duration != default.duration:
            args += f" --duration {self.duration:g}"
        if self.rate != default.rate:
            args += f" --rate {self.rate:g}"
        if self.rss_bound_mib != default.rss_bound_mib:
            args += f" --rss-bound-mib {self.rss_bound_mib:g}"
        if not self.migration:
            args += " --no-migration"
        elif self.migrations != default.migrations:
            args += f" --migrations {self.migrations}"
        return f'make chaos CHAOS_ARGS="{args}"'


@dataclass
class Report:
    options: Options
    workdir: Path
    violations: list[Violation] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    results: list[StreamResult] = field(default_factory=list)
    kills: list[tuple[str, float, float]] = field(default_factory=list)
    base: Stats | None = None
    end: Stats | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0
    load_s: float = 0.0
    # /healthz round trips during the load: how responsive the edge stayed.
    probe_ms: list[float] = field(default_factory=list)
    probe_errors: list[str] = field(default_factory=list)
    # The machine's CPU busy %, sampled during the load.
    machine_busy: list[float] = field(default_factory=list)
    # CPU seconds during the load: the edge, the nodes, the chaos client.
    cpu_s: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def ok(self) -> bool:
        return not self.violations


def write_results(path: Path, report: Report) -> None:
    """One line per request, as the client saw it and as it was joined, for post-mortems."""
    with path.open("w") as out:
        for j in report.figures.get("joined", []):
            r = j.result
            line = {
                "request_id": r.request_id, "kind": r.plan.kind, "t_sent": round(r.t_sent, 4),
                "t_end": round(r.t_end, 4), "ended": r.ended, "cut": r.cut_reason,
                "status": r.status, "view": client_view(r), "run_id": j.run_id, "node": j.node,
                "outcome": j.lines[0].get("outcome") if j.lines else None,
                "cancel_rpcs": j.cancels, "affected": j.affected, "problems": r.problems,
                "t_head": r.t_head, "t_stall": r.t_stall, "retries": j.retries,
                "finish": r.finish_reason,
                "breaks": [[b.from_node, b.to_node, b.reason, b.outcome] for b in j.breaks],
                "mid_answer": j.excuse,
                "attempts": [{"node": x["node"], "outcome": x.get("outcome")} for x in j.attempts],
                "plan": {"cut": str(r.plan.cut), "expect": str(r.plan.expect)},
                "request": r.plan.request,
            }  # fmt: skip
            out.write(json.dumps(line) + "\n")


def _cores() -> int:
    return int(os.cpu_count() or 1)


def _at(t: float) -> str:
    return f"{t:.2f}s" if math.isfinite(t) else "never"


def _restart(node: str, seconds: float | None) -> str:
    return f"{node} {seconds:.2f}s" if seconds is not None else f"{node} no run (or no start times)"


def _ms(values: list[float]) -> str:
    if not values:
        return "none"
    p50, p99 = quantile(values, 0.5), quantile(values, 0.99)
    return f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms (n={len(values)})"


def _bucket(m: dict[str, float], q: float) -> str:
    le = histogram_quantile(m, "iop_edge_migration_gap_seconds", q)
    return "-" if le is None else f"<= {le * 1000:g} ms"


def migration_lines(report: Report) -> list[str]:
    """The summary's mid-answer kill lines: the streams a kill met after their first
    byte and how they ended, the migrations, and the gap each added."""
    o, m = report.options, report.metrics
    g: dict[str, Any] = report.figures.get("migrated", {})
    excused = g.get("excused", {})
    expected, whole = g.get("expected", 0), g.get("whole", 0)
    share = f"{whole / expected:.1%}" if expected else "-"
    mode = "on" if o.migration else "off (--no-migration: [routing] migrations = 0)"
    by: Counter[str] = Counter()
    for k, v in m.items():
        if k.startswith("iop_edge_migrations_total{"):
            by[k.split('outcome="', 1)[1].split('"', 1)[0]] += int(v)
    count = m.get("iop_edge_migration_gap_seconds_count", 0.0)
    lines = [
        f"mid-answer kills {mode}: streams met by a kill after their first byte "
        f"{g.get('met', 0)}; excused {sum(excused.values())} (plan ends otherwise "
        f"{excused.get('plan', 0)}, no other node up {excused.get('no_node', 0)}, more kills "
        f"than its {o.migrations if o.migration else 0} migrations "
        f"{excused.get('kill_per_leg', 0)}, past the deadline {excused.get('deadline', 0)}, "
        f"its client stopped reading {excused.get('stalled', 0)}"
        f"); to complete whole {expected}, completed whole {whole} ({share}, goal 99%"
        f"{'' if o.migration else '; off: not held to it'}); moved "
        f"to another node {g.get('met_migrated', 0)}",
        f"migrations: iop_edge_migrations_total {sum(by.values())} ("
        + (", ".join(f"{k} {v}" for k, v in sorted(by.items())) or "none")
        + f"); edge log: {f_int(report, 'breaks')} breaks after output, "
        f"{f_int(report, 'migrations')} migrations for {f_int(report, 'migrated_requests')} "
        f"requests; gap at each migration: edge histogram iop_edge_migration_gap_seconds "
        f"(break -> the continuation's first event) p50 {_bucket(m, 0.5)}, p99 "
        f"{_bucket(m, 0.99)} (n={count:g}); client (the kill -> the stream's next frame, "
        f"its script's own pause included) {_ms(g.get('client_gaps', []))}",
    ]
    for tag, why in g.get("not_whole", [])[:10] if o.migration else ():
        lines.append(f"  not whole: {tag}: {why}")
    return lines


def f_int(report: Report, key: str) -> int:
    return int(report.figures.get(key, 0))


def summary(report: Report) -> str:
    """The table printed at the end of a run, then every broken invariant."""
    o, f = report.options, report.figures
    lines = [
        f"chaos seed={o.seed} streams={o.streams} concurrency={o.concurrency} "
        f"nodes={o.nodes} node_kills={o.node_kills} idle_close={o.idle_close} rate={o.rate:g}/s",
        f"load {report.load_s:.1f}s, whole run {report.elapsed_s:.1f}s",
        "",
        f"{'kind':<18}{'n':>5}{'to end':>8}{'cut':>6}{'finish':>8}{'error':>7}"
        f"{'http':>6}{'killed':>8}",
    ]
    by_kind: dict[str, Counter[str]] = {k: Counter() for k in KINDS}
    for j in f.get("joined", []):
        r = j.result
        c = by_kind.setdefault(r.plan.kind, Counter())
        view = client_view(r)
        c["n"] += 1
        c["to end"] += r.read_to_end
        c["cut"] += r.ended == "cut"
        c["finish"] += view.startswith("finish:")
        c["error"] += view.startswith("error:")
        c["http"] += view.startswith("http:")
        c["killed"] += j.affected
    for kind, c in by_kind.items():
        lines.append(
            f"{kind:<18}{c['n']:>5}{c['to end']:>8}{c['cut']:>6}{c['finish']:>8}{c['error']:>7}"
            f"{c['http']:>6}{c['killed']:>8}"
        )
    m = report.metrics
    requests = sum(v for k, v in m.items() if k.startswith("iop_edge_requests_total{"))
    statuses: Counter[str] = Counter()
    for k, v in m.items():
        if k.startswith("iop_edge_requests_total{"):
            statuses[k.split('status="', 1)[1].split('"', 1)[0]] += int(v)
    cancels = sum(v for k, v in m.items() if k.startswith("iop_edge_node_cancels_total{"))
    retries = sum(v for k, v in m.items() if k.startswith("iop_edge_retries_total{"))
    warm = sum(1 for r in report.results if r.plan.index < 0)
    lines += [
        "",
        f"requests sent {len(report.results)} (warm-up {warm}, idle-close "
        f"{sum(1 for r in report.results if r.plan.kind == 'idle_close')}); edge counted "
        f"{requests:g} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(statuses.items()))})",
        f"runs-log lines {f.get('run_lines', 0)}; runs lost with a killed node {f.get('excused')}"
        f"; requests hit by a kill {f.get('affected')}; left before the Run reached a node "
        f"{f.get('never_reached')}",
        f"CancelRun sent (metric) {cancels:g}; unknown-id CancelRuns at nodes "
        f"{f.get('unknown_cancels', 0)}; edge gave up just as the node finished "
        f"{f.get('raced', 0)}",
        "node kills: "
        + (", ".join(f"{n} at {d:.2f}s (up {_at(u)})" for n, d, u in report.kills) or "none"),
        f"failover: {f.get('retries', 0)} retries for {f.get('retried_requests', 0)} requests "
        f"(iop_edge_retries_total {retries:g}); requests met by a kill before their first byte "
        f"{f.get('failed_over', 0)}; non-stream answers lost after their run's first output "
        f"{f.get('lost_after_output', 0)}; failed with a kill met by every attempt "
        f"{f.get('kill_per_attempt', 0)}; run ids on two or more nodes "
        f"{f.get('several_nodes', 0)}"
        + (f" ({f['untimed']} lines without start times)" if f.get("untimed") else ""),
        "restart (node listening -> its first run started): "
        + (", ".join(_restart(n, s) for n, s in f.get("restarts", [])) or "no restart"),
        *migration_lines(report),
    ]
    edges = sorted(
        [(r.t_sent, 1) for r in report.results] + [(r.t_end, -1) for r in report.results]
    )
    in_flight = peak = 0
    for _, step in edges:
        in_flight += step
        peak = max(peak, in_flight)
    lines.append(f"peak streams in flight: {peak}")
    if report.probe_ms:
        probes = sorted(report.probe_ms)
        lines.append(
            f"CPU during the {report.load_s:.1f}s load: edge {report.cpu_s[0]:.1f}s, nodes "
            f"{report.cpu_s[1]:.1f}s, chaos client {report.cpu_s[2]:.1f}s; /healthz round trip "
            f"p50 {probes[len(probes) // 2]:.0f} ms, max {probes[-1]:.0f} ms"
            + (f", {len(report.probe_errors)} failed" if report.probe_errors else "")
        )
    if report.machine_busy:
        busy = report.machine_busy
        lines.append(
            f"machine CPU busy during the load: mean {sum(busy) / len(busy):.0f}%, "
            f"max {max(busy):.0f}% (all processes, {_cores()} cores)"
        )
    if report.base and report.end:
        growth = (report.end.rss - report.base.rss) / 2**20
        lines += [
            f"edge baseline: {report.base.show()}",
            f"edge after:    {report.end.show()}  (RSS +{growth:.1f} MiB, bound "
            f"{o.rss_bound_mib:g} MiB)",
        ]
    lines.append("")
    broken: dict[str, list[Violation]] = {}
    for violation in report.violations:
        broken.setdefault(violation.invariant, []).append(violation)
    for name, text in INVARIANTS.items():
        if name == "migrated" and not o.migration:
            text = "off (--no-migration): a stream finished after a kill has the whole answer"
        lines.append(f"{'FAIL' if name in broken else 'ok  '}  {name:<11} {text}")
    for name, found in broken.items():
        lines.append(f"\nBROKEN {name} ({len(found)}):")
        for violation in found[:25]:
            shown = ", ".join(violation.ids[:10]) + (", ..." if len(violation.ids) > 10 else "")
            lines.append(f"  - {violation.detail}" + (f"  [{shown}]" if violation.ids else ""))
        if len(found) > 25:
            lines.append(f"  ... and {len(found) - 25} more")
    if not report.ok:
        lines += ["", f"replay: {report.options.replay()}", f"logs kept in {report.workdir}"]
    elif report.options.keep_logs:
        lines += ["", f"logs kept in {report.workdir}"]
    return "\n".join(lines)
