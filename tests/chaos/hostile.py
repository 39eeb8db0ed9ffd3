"""`python -m tests.chaos.hostile` (`make hostile`): the hostile mix beside normal traffic.

    make hostile HOSTILE_ARGS="--phase-s 8 --seed 7"

One `iop-sim-node` and, per phase, a fresh `iop-edge` (API keys on, default
timeouts), real processes on 127.0.0.1. Each phase runs one attack of
`tests.chaos.attacks` (connection flood, stalled readers of 64 KiB deltas,
tool flood, `{`-line model text, ReDoS schema, fuzzed frames, the known
one-packet triggers; and the second round: nesting past the recursion limit
in every free-form field, bodies of tiny parts, tool history or many
messages, hosted tools sized for the log, a 3.8 MB delta of `<`, script
numbers a node must refuse, HTTP/2 streams whose window never opens, a
throttled key sending 4 MB bodies), or all of them at once (`all`), for
`--phase-s` seconds beside normal requests, while /healthz is probed every
100 ms and the edge's RSS sampled. It prints a table, then one JSON line
with the figures and the goals: the process stayed alive; /healthz p99 <
100 ms; RSS peak < 256 MiB above idle; no normal request failed; every node
slot came back once the phase ended. Exits 0 when every goal holds, 1
otherwise. Bounded: each phase by `--phase-s` plus the normal
requests' limit; the edge is killed past `--rss-cap-mib` (the machine is
shared).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.cleanup import keep_dir, remove_dir, run_program, run_trio, temp_dir
from tests.chaos.attacks import (
    ATTACKS,
    ENDED_THE_EDGE,
    THROTTLED_CONFIG,
    UNTIMED,
    Normal,
    Sizes,
    Tally,
    Target,
)
from tests.chaos.procs import EdgeProcess, ProcessError, SimNode, probe_healthz, stop_process
from tests.hostile.cases import KEY

PHASES = (*ATTACKS, "all")
HEALTHZ_P99_GOAL_MS = 100.0
RSS_GOAL_MIB = 256.0
NORMAL_WORKERS = 2
# After the attack: how long the normal requests in flight may take to finish.
END_GRACE_S = 5.0
# In the `all` phase, these start halfway through (they end the process on today's edge).
LATE = frozenset({"fuzz", "one_packet"})
RSS_EVERY_S = 0.1
MIB = 2**20
# After the phase: how long the node slots taken during it may take to come back.
SLOTS_GRACE_S = 10.0


@dataclass
class Phase:
    """What one phase measured."""

    name: str
    alive: bool = True
    exit_code: int | None = None
    rss_idle: int = 0
    rss_peak: int = 0
    rss_capped: bool = False
    probe_ms: list[float] = field(default_factory=list)
    probe_errors: list[str] = field(default_factory=list)
    # Node slots still taken once the phase ended and its grace passed (None: not read).
    slots_left: int | None = None
    normal: Normal = field(default_factory=Normal)
    tallies: dict[str, Tally] = field(default_factory=dict)

    @property
    def above_idle_mib(self) -> float:
        return max(0, self.rss_peak - self.rss_idle) / MIB


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _watch_rss(edge: EdgeProcess, phase: Phase, cap: int) -> None:
    """Sample the edge's RSS; kill it past `cap` (the figure is then at least the cap)."""
    while True:
        if not edge.alive():
            phase.alive = False
        rss = edge.rss()
        phase.rss_peak = max(phase.rss_peak, rss)
        if rss > cap and edge.process is not None:
            phase.rss_capped = True
            edge.process.kill()
        await trio.sleep(RSS_EVERY_S)


async def _bounded(attack: str, target: Target, tally: Tally, delay: float, limit: float) -> None:
    await trio.sleep(delay)
    with trio.move_on_after(limit):
        await ATTACKS[attack](target, tally)


async def _warm(edge: EdgeProcess) -> None:
    """A few normal requests (streamed and not), then a pause: the idle baseline."""
    normal = Normal()
    async with trio.open_nursery() as nursery:
        for w in range(NORMAL_WORKERS):
            nursery.start_soon(partial(normal.worker, edge, w, trio.Event(), requests=2))
    if normal.errors:
        raise ProcessError(f"the edge failed its warm-up requests: {normal.examples}")
    await trio.sleep(0.5)


async def _slots_left(edge: EdgeProcess) -> int:
    """The node slots still taken once everything of the phase is gone, read until they are
    all back or SLOTS_GRACE_S passed (-1: the edge did not answer)."""
    left = -1
    with trio.move_on_after(SLOTS_GRACE_S):
        while True:
            try:
                left = await edge.in_flight()
            except httpx.HTTPError:
                left = -1
            if left == 0:
                break
            await trio.sleep(0.1)
    return left


async def run_phase(
    name: str, node: SimNode, workdir: Path, sizes: Sizes, seconds: float, cap: int
) -> Phase:
    """One phase on a fresh edge: warm up, idle RSS, then the attack beside normal traffic."""
    phase = Phase(name)
    phase_dir = workdir / name
    await trio.to_thread.run_sync(phase_dir.mkdir)
    edge = EdgeProcess(phase_dir, api_keys=(KEY,), timeouts=None, extra_config=THROTTLED_CONFIG)
    await edge.start([node])
    target = Target(edge, [node], sizes)
    attacks = list(ATTACKS) if name == "all" else [name]
    try:
        await _warm(edge)
        phase.rss_idle = phase.rss_peak = edge.rss()
        stop = trio.Event()
        async with trio.open_nursery() as outer:
            outer.start_soon(_watch_rss, edge, phase, cap)
            outer.start_soon(probe_healthz, edge, phase.probe_ms, phase.probe_errors)
            async with trio.open_nursery() as normal:
                for w in range(NORMAL_WORKERS):
                    normal.start_soon(phase.normal.worker, edge, w, stop)
                async with trio.open_nursery() as hostile:
                    hostile.start_soon(trio.sleep, seconds)
                    for attack in attacks:
                        phase.tallies[attack] = tally = Tally()
                        # Together, the attacks that end the process go in halfway through.
                        delay = seconds / 2 if name == "all" and attack in LATE else 0.0
                        untimed = attack in UNTIMED and name != "all"
                        limit = math.inf if untimed else seconds - delay
                        hostile.start_soon(_bounded, attack, target, tally, delay, limit)
                stop.set()  # the normal workers finish the request they are in...
                normal.cancel_scope.deadline = trio.current_time() + END_GRACE_S  # ...or fail
            outer.cancel_scope.cancel()
        # A one-packet trigger that ended the edge was followed by a restart, which the
        # RSS watch, sampling every RSS_EVERY_S, can miss: the tally has it.
        ended = sum(t.outcomes[ENDED_THE_EDGE] for t in phase.tallies.values())
        phase.alive = phase.alive and edge.alive() and not ended
        if phase.alive:
            phase.slots_left = await _slots_left(edge)
    finally:
        phase.exit_code = await edge.stop()
    return phase


def _figures(phases: list[Phase]) -> dict[str, Any]:
    probes = [ms for p in phases for ms in p.probe_ms]
    normal_n = sum(p.normal.done + sum(p.normal.errors.values()) for p in phases)
    normal_err = sum(sum(p.normal.errors.values()) for p in phases)
    figures: dict[str, Any] = {
        "alive": all(p.alive for p in phases),
        "healthz_p50_ms": round(_pct(probes, 0.5), 1),
        "healthz_p99_ms": round(_pct(probes, 0.99), 1),
        "healthz_failed": sum(len(p.probe_errors) for p in phases),
        "rss_idle_mib": round(min((p.rss_idle for p in phases), default=0) / MIB, 1),
        "rss_peak_mib": round(max((p.rss_peak for p in phases), default=0) / MIB, 1),
        "rss_peak_above_idle_mib": round(max((p.above_idle_mib for p in phases), default=0), 1),
        "normal_requests": normal_n,
        "normal_errors": normal_err,
        "normal_error_rate": round(normal_err / normal_n, 4) if normal_n else None,
        "slots_left": {p.name: p.slots_left for p in phases if p.slots_left},
    }
    figures["goals"] = {
        "alive": figures["alive"],
        "healthz_p99_below_100ms": figures["healthz_p99_ms"] < HEALTHZ_P99_GOAL_MS
        and not figures["healthz_failed"],
        "rss_below_256mib_above_idle": figures["rss_peak_above_idle_mib"] < RSS_GOAL_MIB,
        "no_normal_errors": normal_n > 0 and normal_err == 0,
        "every_slot_back": all(p.slots_left == 0 for p in phases if p.alive),
    }
    figures["ok"] = all(figures["goals"].values())
    return figures


def report(phases: list[Phase], sizes: Sizes, seconds: float) -> str:
    lines = [
        f"hostile mix: {len(phases)} phases of {seconds:g}s, sizes {asdict(sizes)}",
        "",
        f"{'phase':<16}{'alive':>6}{'exit':>6}{'hz p50':>8}{'hz p99':>8}{'hz max':>8}{'hz fail':>8}"
        f"{'rss idle':>10}{'peak':>8}{'+idle':>8}{'normal':>8}{'errors':>8}{'slots':>6}",
    ]
    for p in phases:
        code = "-" if p.exit_code is None else str(p.exit_code)
        lines.append(
            f"{p.name:<16}{'yes' if p.alive else 'NO':>6}{code:>6}"
            f"{_pct(p.probe_ms, 0.5):>8.0f}{_pct(p.probe_ms, 0.99):>8.0f}"
            f"{max(p.probe_ms, default=float('nan')):>8.0f}{len(p.probe_errors):>8}"
            f"{p.rss_idle / MIB:>10.0f}{p.rss_peak / MIB:>8.0f}{p.above_idle_mib:>8.0f}"
            f"{p.normal.done + sum(p.normal.errors.values()):>8}{sum(p.normal.errors.values()):>8}"
            f"{'-' if p.slots_left is None else p.slots_left:>6}"
            + ("  (killed at the RSS cap)" if p.rss_capped else "")
        )
    lines.append("")
    for p in phases:
        for name, tally in p.tallies.items():
            lines.append(f"{p.name}/{name}: {tally.show()}")
            lines += [f"    {note}" for note in tally.notes]
        if p.normal.errors:
            lines.append(f"{p.name}/normal errors: {dict(p.normal.errors)}")
            lines += [f"    e.g. {e}" for e in p.normal.examples]
    return "\n".join(lines)


async def run_mix(
    phases: tuple[str, ...], sizes: Sizes, seconds: float, cap_mib: float, keep: bool
) -> tuple[list[Phase], Path]:
    workdir = temp_dir(f"iop-hostile-{sizes.seed}-", keep=keep)
    node = SimNode("n0", workdir)
    done: list[Phase] = []
    try:
        await node.start()
        for name in phases:
            if node.process is None or node.process.poll() is not None:
                await node.start()
            done.append(await run_phase(name, node, workdir, sizes, seconds, int(cap_mib * MIB)))
    finally:
        await stop_process(node.process, signal.SIGTERM)
    if not keep and done and _figures(done)["ok"]:
        remove_dir(workdir)
    else:
        keep_dir(workdir)
    return done, workdir


def build_parser() -> argparse.ArgumentParser:
    d = Sizes()
    p = argparse.ArgumentParser(
        prog="python -m tests.chaos.hostile", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated, from {', '.join(PHASES)}"
    )
    p.add_argument("--phase-s", type=float, default=6.0, help="seconds per phase (default 6)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--conns", type=int, default=d.conns, help="idle connections (conn_flood)")
    p.add_argument("--stalled", type=int, default=d.stalled, help="non-reading streaming clients")
    p.add_argument(
        "--stalled-deltas",
        type=int,
        default=d.stalled_deltas,
        help="64 KiB deltas per stalled answer",
    )
    p.add_argument("--tools", type=int, default=d.tools)
    p.add_argument("--brace-lines", type=int, default=d.brace_lines)
    p.add_argument("--redos-a", type=int, default=d.redos_a, help="a's before the b")
    p.add_argument("--h2-conns", type=int, default=d.h2_conns, help="HTTP/2 stalled connections")
    p.add_argument("--h2-streams", type=int, default=d.h2_streams, help="streams per connection")
    p.add_argument("--throttled", type=int, default=d.throttled, help="throttled key's clients")
    p.add_argument("--rss-cap-mib", type=float, default=3072.0, help="kill the edge past this RSS")
    p.add_argument("--keep-logs", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    phases = tuple(x for x in args.phases.split(",") if x)
    unknown = [x for x in phases if x not in PHASES]
    if unknown or not phases or args.phase_s <= 0:
        print(
            f"hostile: unknown phase(s) {unknown}; phases are {', '.join(PHASES)}", file=sys.stderr
        )
        return 2
    sizes = Sizes(**{f.name: getattr(args, f.name) for f in fields(Sizes)})
    try:
        done, workdir = run_trio(
            run_mix, phases, sizes, args.phase_s, args.rss_cap_mib, args.keep_logs
        )
    except ProcessError as exc:
        print(f"hostile: {exc}", file=sys.stderr)
        return 2
    figures = _figures(done)
    print(report(done, sizes, args.phase_s))
    if not figures["ok"] or args.keep_logs:
        print(f"logs kept in {workdir}")
    per_phase = {
        p.name: {
            "alive": p.alive,
            "exit_code": p.exit_code,
            "healthz_p99_ms": round(_pct(p.probe_ms, 0.99), 1),
            "healthz_failed": len(p.probe_errors),
            "rss_peak_above_idle_mib": round(p.above_idle_mib, 1),
            "normal_errors": sum(p.normal.errors.values()),
            "slots_left": p.slots_left,
        }
        for p in done
    }
    print(json.dumps({"hostile": figures, "seed": sizes.seed, "phases": per_phase}))
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(run_program(main, "hostile"))
