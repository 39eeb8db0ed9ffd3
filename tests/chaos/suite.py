"""One chaos run, start to finish: processes up, warm-up, baseline, load, kills, checks.

`run_suite(options)` is what `python -m tests.chaos` and the small pytest
version both call. It starts the nodes and the edge as real processes on
127.0.0.1, runs a few warm-up streams, takes the edge's resource baseline,
drives every planned stream (at most `concurrency` at once) while killing
and restarting nodes on schedule, waits (bounded) for the edge to go idle
and the runs logs to settle, then stops everything and checks the
invariants. Every wait is bounded; the whole load by `duration`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psutil  # type: ignore[import-untyped]
import trio

from benchmarks.cleanup import keep_dir, remove_dir, temp_dir
from tests.chaos.checks import FD_SLACK, THREAD_SLACK, check_all
from tests.chaos.client import StreamResult, run_stream
from tests.chaos.plan import Kill, make_scenario, warmup_plans
from tests.chaos.procs import (
    EdgeProcess,
    ProcessError,
    SimNode,
    Stats,
    cpu_seconds,
    probe_healthz,
)
from tests.chaos.report import Options, Report, summary, write_results
from tests.chaos.witness import Observed

T = TypeVar("T", bound=Sequence[Any])

IDLE_TIMEOUT_S = 15.0
SETTLE_TIMEOUT_S = 10.0
RESTART_ATTEMPTS = 5


class _Progress:
    def __init__(self) -> None:
        self.done = 0


async def _drive(
    results: list[StreamResult],
    port: int,
    t0: float,
    *,
    concurrency: int,
    rate: float = math.inf,
    kills: Sequence[Kill] = (),
    nodes: Sequence[SimNode] = (),
) -> None:
    """Run `results`' plans in order, at most `concurrency` at once and `rate` new ones
    a second, with the node kills."""
    limiter = trio.CapacityLimiter(concurrency)
    progress = _Progress()

    async def one(result: StreamResult) -> None:
        try:
            await run_stream(result, port, t0)
        finally:
            limiter.release_on_behalf_of(result)
            progress.done += 1

    async with trio.open_nursery() as nursery:
        if kills:
            nursery.start_soon(_killer, kills, nodes, progress, t0)
        start = trio.current_time()
        for i, result in enumerate(results):
            await trio.sleep_until(start + i / rate)
            await limiter.acquire_on_behalf_of(result)
            nursery.start_soon(one, result)


def _cpu(edge: EdgeProcess, nodes: list[SimNode]) -> tuple[float, float, float]:
    """CPU seconds so far of the edge, the nodes' current processes, and this process.

    A node killed during the load takes its CPU time with it: the nodes'
    figure is a lower bound when there were kills.
    """
    node_s = sum(cpu_seconds(n.process.pid) for n in nodes if n.process is not None)
    return edge.cpu_seconds(), node_s, cpu_seconds(os.getpid())


async def _machine(out: list[float]) -> None:
    """The whole machine's CPU busy % every 0.5 s (until cancelled): other work shows here."""
    psutil.cpu_percent()
    while True:
        await trio.sleep(0.5)
        out.append(psutil.cpu_percent())


async def _killer(
    kills: Sequence[Kill], nodes: Sequence[SimNode], progress: _Progress, t0: float
) -> None:
    for kill in kills:
        while progress.done < kill.after_done:  # noqa: ASYNC110 - a counter, not an event
            await trio.sleep(0.01)
        await trio.sleep(kill.delay_s)
        node = nodes[kill.node]
        await node.kill()
        t_kill = trio.current_time() - t0
        node.downtimes.append((t_kill, math.inf))  # down until it serves again
        await trio.sleep(kill.down_s)
        for attempt in range(RESTART_ATTEMPTS):
            try:
                await node.start()
                break
            except ProcessError:
                if attempt == RESTART_ATTEMPTS - 1:
                    raise
                await trio.sleep(0.2)
        node.downtimes[-1] = (t_kill, trio.current_time() - t0)


async def _wait_idle(edge: EdgeProcess) -> int:
    """Wait (bounded) until the edge has no stream and no run in flight; returns runs left."""
    left = -1
    with trio.move_on_after(IDLE_TIMEOUT_S):
        while True:
            metrics = await edge.metrics()
            left = await edge.in_flight()
            if metrics.get("iop_edge_active_streams") == 0 and left == 0:
                return 0
            await trio.sleep(0.1)
    return left


async def _settle(edge: EdgeProcess, base: Stats) -> Stats:
    """The edge's resources once back near the baseline (or after SETTLE_TIMEOUT_S)."""
    stats = edge.stats()
    with trio.move_on_after(SETTLE_TIMEOUT_S):
        while (
            stats.fds > base.fds + FD_SLACK
            or stats.threads > base.threads + THREAD_SLACK
            or stats.http_conns
            or stats.close_wait
        ):
            await trio.sleep(0.1)
            stats = edge.stats()
    return stats


async def _stable(
    read: Callable[[], T], quiet_s: float, limit_s: float, done: Callable[[T], bool] | None = None
) -> T:
    """Re-read until `done(value)` or the value's size has not changed for `quiet_s`."""
    value = read()
    size, since = len(value), trio.current_time()
    with trio.move_on_after(limit_s):
        while not (done is not None and done(value)):
            await trio.sleep(0.1)
            value = read()
            if len(value) != size:
                size, since = len(value), trio.current_time()
            elif trio.current_time() - since >= quiet_s:
                break
    return value


def _runs_lines(nodes: list[SimNode]) -> list[tuple[str, dict[str, Any]]]:
    lines: list[tuple[str, dict[str, Any]]] = []
    for node in nodes:
        for life, path in enumerate(node.runs_logs):
            if not path.exists():
                continue
            for raw in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue  # a line cut short by kill -9
                if isinstance(record, dict):
                    lines.append((node.name, {**record, "_life": life}))
    return lines


async def run_suite(options: Options) -> Report:
    """One chaos run; the report says which invariants broke (none, if all is well)."""
    started = trio.current_time()
    workdir = temp_dir(f"iop-chaos-{options.seed}-", keep=options.keep_logs)
    report = Report(options, workdir)
    scenario = make_scenario(
        options.seed, options.streams, options.nodes, options.node_kills, options.idle_close
    )
    nodes = [SimNode(f"n{i}", workdir) for i in range(options.nodes)]
    edge = EdgeProcess(workdir)
    edge.migrations = options.migrations if options.migration else 0
    edge_exit: int | None = None
    try:
        for node in nodes:
            await node.start()
        await edge.start(nodes)
        t0 = trio.current_time()
        warm = [StreamResult(p, p.request_id(options.seed)) for p in warmup_plans(options.seed)]
        await _drive(warm, edge.port, t0, concurrency=len(warm))
        await _wait_idle(edge)
        await trio.sleep(0.5)
        report.base = base = edge.stats()

        results = [StreamResult(p, p.request_id(options.seed)) for p in scenario.plans]
        load_start = trio.current_time()
        cpu_start = _cpu(edge, nodes)
        with trio.move_on_after(options.duration) as bound:
            async with trio.open_nursery() as probe:
                probe.start_soon(probe_healthz, edge, report.probe_ms, report.probe_errors)
                probe.start_soon(_machine, report.machine_busy)
                await _drive(
                    results,
                    edge.port,
                    t0,
                    concurrency=options.concurrency,
                    rate=options.rate,
                    kills=scenario.kills,
                    nodes=nodes,
                )
                probe.cancel_scope.cancel()
        report.load_s = trio.current_time() - load_start
        cpu_end = _cpu(edge, nodes)
        report.cpu_s = (
            cpu_end[0] - cpu_start[0],
            cpu_end[1] - cpu_start[1],
            cpu_end[2] - cpu_start[2],
        )
        in_flight = await _wait_idle(edge)
        report.end = end = await _settle(edge, base)
        report.metrics = await edge.metrics()
        started_results = [r for r in [*warm, *results] if r.ended]
        report.results = started_results
        records = await _stable(edge.records, 0.5, 5.0)
        known = {str(r.get("run_id")) for r in records if "run_id" in r}

        def all_logged(lines: list[tuple[str, dict[str, Any]]]) -> bool:
            return known <= {str(rec.get("run_id")) for _, rec in lines if "outcome" in rec}

        runs_lines = await _stable(lambda: _runs_lines(nodes), 2.0, 10.0, all_logged)
    finally:
        edge_exit = await edge.stop()
        for node in nodes:
            await node.stop()
    report.kills = [(n.name, down, up) for n in nodes for down, up in n.downtimes]
    observed = Observed(
        results=started_results,
        edge_records=records,
        runs_lines=runs_lines,
        downtimes={n.name: n.downtimes for n in nodes},
        metrics=report.metrics,
        base=base,
        end=end,
        in_flight_end=in_flight,
        edge_exit=edge_exit,
        load_bound_hit=bound.cancelled_caught,
        rss_bound_mib=options.rss_bound_mib,
        not_started=sum(1 for r in results if not r.ended),
        listening={n.name: list(n.listening_at) for n in nodes},
        migration=options.migration,
        migrations=options.migrations if options.migration else 0,
    )
    report.violations, report.figures = check_all(observed)
    write_results(workdir / "results.jsonl", report)
    report.elapsed_s = trio.current_time() - started
    (workdir / "summary.txt").write_text(summary(report) + "\n")
    if report.ok and not options.keep_logs:
        remove_dir(workdir)
    else:
        keep_dir(workdir)
    return report
