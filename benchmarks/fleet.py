"""Routing policies over a fleet of simulated nodes with a KV cache (`--fleet`).

Each cell of the run is one routing policy (`[routing] policy`) on one workload of
`benchmarks.prompts`, on processes of its own so every cache starts cold: one
`iop-sim-node --nodes 4` process (four nodes, each its own port, runs log and KV cache:
`--kv-tokens`, `--prefill-us-per-token`, `--max-runs`) and a fresh edge in front of
the four. One load-generator process plays the workload at a fixed concurrency
(`benchmarks.jobs.fleet`). Figures per cell, from one run:

- cache hit ratio: the sum of `usage.prompt_tokens_details.cached_tokens` over the sum
  of `usage.prompt_tokens`, from the answers (`stream_options.include_usage`);
- TTFT p50/p99: request written to first content frame, at the client;
- requests/s at that concurrency (answered requests over the workload's wall time);
- the busiest node's share of runs, from the nodes' runs logs;
- the edge's CPU per request (every thread, from the kernel's nanosecond counters).

The cache is sized from the shared-prefix workload: each node holds `cache_share` of
its working set (default 1.25/4), so the working set is larger than one node's cache
and smaller than the fleet's. The same run puts two edges in front of the same four
nodes (the shared-prefix workload split between them, `cache_aware`) beside one edge.
A policy this edge refuses (its config check) is skipped with the edge's own words; a
node without the KV flags (an older `iop-sim-node`) is run without them and caches
nothing, and the run says so. SMG beside the edge on the same workloads:
`benchmarks.fleetpeer`; the cache-pressure workload (open-loop, rising rates, the
exact index against the approximate one): `benchmarks.pressure`.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.fleetreport import figures
from benchmarks.loadgen import Pool
from benchmarks.prompts import (
    Workload,
    agent_sessions,
    hot_prefix,
    random_prompts,
    shared_prefixes,
)
from benchmarks.stack import (
    cpu_s,
    free_port,
    get_status,
    spawn,
    stop_process,
    up_nodes,
    venv_script,
)

STARTUP_TIMEOUT_S = 60.0
# Ports an edge is given before a taken one is its failure (`edges`).
PORT_TRIES = 3
RUNS_LOG_WAIT_S = 5.0
BLOCK_TOKENS = 64
POLICIES = ("least_loaded", "affinity", "cache_aware")
WORKLOADS = ("shared", "sessions", "hot", "random")
# `--fleet-only` takes these and the cache-pressure workload (`benchmarks.pressure`).
ALL_WORKLOADS = (*WORKLOADS, "pressure")
mono = time.monotonic


@dataclass(frozen=True)
class FleetSettings:
    nodes: int = 4
    concurrency: int = 16
    # shared prefixes: groups x requests per group, each group's system prompt
    groups: int = 16
    per_group: int = 12
    prefix_tokens: int = 6000
    # agent sessions: sessions x turns, more sessions than requests in flight; a short
    # shared system prompt, each session's context, one tool result per turn (the
    # sessions' working set about the shared prefixes' one)
    sessions: int = 24
    turns: int = 8
    agent_system_tokens: int = 100
    agent_context_tokens: int = 1200
    tool_tokens: int = 400
    # hot prefix and random prompts: requests, each prompt of prefix_tokens
    hot_requests: int = 192
    random_requests: int = 96
    # the nodes: prefill time per uncached prompt token, runs at once, and each node's
    # KV cache as a share of the shared-prefix working set
    prefill_us_per_token: int = 50
    max_runs: int = 8
    cache_share: float = 1.25 / 4
    seed: int = 27
    timeout_s: float = 300.0

    @property
    def kv_tokens(self) -> int:
        """Each node's KV cache, in tokens: whole blocks of 64."""
        want = self.groups * self.prefix_tokens * self.cache_share
        return -(-int(want) // BLOCK_TOKENS) * BLOCK_TOKENS


QUICK = FleetSettings(
    concurrency=8, groups=8, per_group=4, prefix_tokens=2000, sessions=12, turns=4,
    agent_context_tokens=500, tool_tokens=300, hot_requests=48, random_requests=24,
    prefill_us_per_token=100, timeout_s=120.0,
)  # fmt: skip


def workload(name: str, s: FleetSettings) -> Workload:
    if name == "shared":
        return shared_prefixes(s.seed, s.groups, s.per_group, s.prefix_tokens)
    if name == "sessions":
        return agent_sessions(
            s.seed, s.sessions, s.turns, s.agent_system_tokens, s.agent_context_tokens,
            s.tool_tokens,
        )  # fmt: skip
    if name == "hot":
        return hot_prefix(s.seed, s.hot_requests, s.prefix_tokens)
    if name == "random":
        return random_prompts(s.seed, s.random_requests, s.prefix_tokens)
    raise ValueError(f"unknown workload {name!r}")


class Refused(Exception):
    """The edge would not start with this configuration (a policy it does not know)."""


@functools.cache
def sim_has_kv() -> bool:
    """Whether this `iop-sim-node` models a KV cache (`--kv-tokens`, `--prefill-us-per-token`)."""
    done = subprocess.run(
        [venv_script("iop-sim-node"), "--help"], capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    return "--kv-tokens" in done.stdout and "--prefill-us-per-token" in done.stdout


def node_flags(s: FleetSettings) -> list[str]:
    """The `iop-sim-node` flags of the fleet run's nodes: their slots, and the KV model
    when this node has it."""
    flags = ["--max-runs", str(s.max_runs)]
    if sim_has_kv():
        flags += [
            "--kv-tokens", str(s.kv_tokens),
            "--prefill-us-per-token", str(s.prefill_us_per_token),
        ]  # fmt: skip
    return flags


def sim_fleet(where: Path, s: FleetSettings) -> contextlib.AbstractContextManager[SimFleet]:
    """`s.nodes` simulated nodes in one process, each with its KV cache; stopped after."""
    return sim_nodes(where, s.nodes, node_flags(s))


@contextmanager
def sim_nodes(where: Path, nodes: int, flags: list[str]) -> Iterator[SimFleet]:
    """`nodes` simulated nodes in one process, started with `flags`; stopped after."""
    fleet = SimFleet(where, nodes, flags)
    try:
        fleet.start()
        yield fleet
    finally:
        stop_process(fleet.proc)


class SimFleet:
    """One `iop-sim-node --nodes N` process: its nodes' addresses and runs logs."""

    def __init__(self, where: Path, nodes: int, flags: list[str]) -> None:
        self.where = where
        self.nodes = nodes
        self.flags = flags
        self.proc: subprocess.Popen[bytes] | None = None
        self.addresses: list[str] = []

    def start(self) -> None:
        nodes = self.nodes
        log = self.where / "sim.log"
        flags = [
            "--nodes", str(nodes), "--listen", "127.0.0.1:0", "--name", "fleet",
            "--runs-log", str(self.where / "runs.jsonl"), *self.flags,
        ]  # fmt: skip
        self.proc = spawn([venv_script("iop-sim-node"), *flags], log)
        deadline = mono() + STARTUP_TIMEOUT_S
        while mono() < deadline:
            lines = [x for x in log.read_text(errors="replace").splitlines() if "listening on" in x]
            if len(lines) >= nodes:
                self.addresses = [x.rsplit(" ", 1)[-1] for x in lines[:nodes]]
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"iop-sim-node exited: {log.read_text()[-500:]}")
            time.sleep(0.05)
        raise SystemExit("iop-sim-node did not start in time")

    def runs_log(self, i: int) -> Path:
        return self.where / (f"runs-{i + 1}.jsonl" if self.nodes > 1 else "runs.jsonl")

    def runs_per_node(self, expected: int) -> list[int]:
        """Runs each node logged, once they add up to `expected` (a node writes a run's
        line up to a second after it ended) or RUNS_LOG_WAIT_S passed."""
        deadline = mono() + RUNS_LOG_WAIT_S
        while True:
            counts = []
            for i in range(self.nodes):
                path = self.runs_log(i)
                text = path.read_text(errors="replace") if path.exists() else ""
                counts.append(sum(1 for line in text.splitlines() if '"run_id"' in line))
            if sum(counts) >= expected or mono() > deadline:
                return counts
            time.sleep(0.1)


EDGE_CONFIG = """\
[server]
listen = "127.0.0.1:{port}"
drain_timeout_s = 2

[log]
level = "WARNING"

[timeouts]
first_event_s = 120
idle_s = 120
total_s = 600

[routing]
policy = "{policy}"
{extra}"""


@dataclass
class Edges:
    """Edge processes with the same nodes and policy: their URLs and CPU."""

    procs: list[subprocess.Popen[bytes]]
    ports: list[int]

    @property
    def targets(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.ports]

    def cpu(self) -> float:
        return sum(cpu_s(p.pid) for p in self.procs)


@contextmanager
def edges(
    where: Path, node_sets: list[list[str]], policy: str, extra: str = "", node_keys: str = ""
) -> Iterator[Edges]:
    """One edge per entry of `node_sets`, in front of those nodes with `policy` (and the
    config tables `extra`, and the keys `node_keys` in each `[[nodes]]`), all started at
    once, then each ready with every node up.

    Raises `Refused` with the edge's own words when one exits at startup (its
    configuration refused). An edge whose port was taken between `free_port` and its
    bind (by another process's outgoing connection, say) starts again on another,
    up to PORT_TRIES times.
    """
    started = Edges([], [])

    def start(e: int) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        nodes = "".join(
            f'\n[[nodes]]\nname = "node-{i + 1}"\naddress = "{a}"\n{node_keys}'
            for i, a in enumerate(node_sets[e])
        )
        config = where / f"edge-{e}.toml"
        config.write_text(EDGE_CONFIG.format(port=port, policy=policy, extra=extra) + nodes)
        return spawn(
            [venv_script("iop-edge"), "--config", str(config)], where / f"edge-{e}.log"
        ), port

    try:
        for e in range(len(node_sets)):
            proc, port = start(e)
            started.procs.append(proc)
            started.ports.append(port)
        deadline = mono() + STARTUP_TIMEOUT_S
        for e in range(len(node_sets)):
            tries = 1
            while True:
                proc, port = started.procs[e], started.ports[e]
                if proc.poll() is not None:
                    text = (where / f"edge-{e}.log").read_text(errors="replace").strip()
                    last = text.splitlines()[-1] if text else f"exit {proc.returncode}"
                    if "Address already in use" in last and tries < PORT_TRIES:
                        tries += 1
                        started.procs[e], started.ports[e] = start(e)
                        continue
                    # "iop-edge: FILE: key: message": the message, without the file's path.
                    raise Refused(last.rsplit(".toml: ", 1)[-1][-300:])
                base = f"http://127.0.0.1:{port}"
                if get_status(base + "/readyz") == 200 and up_nodes(base) >= len(node_sets[e]):
                    break
                if mono() > deadline:
                    raise SystemExit(f"edge {e} did not see its nodes up in time")
                time.sleep(0.1)
        yield started
    finally:
        for proc in started.procs:
            stop_process(proc)


def play(pool: Pool, targets: list[tuple[str, int]], w: Workload, s: FleetSettings) -> Any:
    return pool.run(
        "fleet", s.timeout_s + 60, targets=targets, sequences=w.sequences,
        concurrency=s.concurrency, timeout_s=s.timeout_s,
    )  # fmt: skip


def measure_cell(
    pool: Pool, where: Path, s: FleetSettings, policy: str, w: Workload, count: int = 1
) -> dict[str, Any]:
    """One policy on one workload, on fresh nodes and `count` fresh edges."""
    where.mkdir(parents=True, exist_ok=True)
    with sim_fleet(where, s) as fleet, edges(where, [fleet.addresses] * count, policy) as gw:
        c0 = gw.cpu()
        raw = play(pool, gw.targets, w, s)
        c1 = gw.cpu()
        ok = sum(1 for r in raw["records"] if "error" not in r)
        runs = fleet.runs_per_node(ok)
    return figures(raw, runs, c1 - c0)


def measure_fleet(
    pool: Pool,
    tmp: Path,
    s: FleetSettings,
    log: Callable[[str], None] | None = None,
    names: tuple[str, ...] = WORKLOADS,
) -> dict[str, Any]:
    """Every policy on every workload of `names` (the policies in turn within a workload),
    then two edges on the shared-prefix workload (when `names` has it)."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    kv = sim_has_kv()
    out: dict[str, Any] = {
        "settings": {**asdict(s), "kv_tokens": s.kv_tokens}, "kv_model": kv, "workloads": {},
        "cells": {}, "skipped": {},
    }  # fmt: skip
    if not kv:
        say(
            "fleet: this iop-sim-node has no --kv-tokens: the nodes cache nothing "
            "(hit ratio 0) and prefill takes no time"
        )
    policies = list(POLICIES)
    for name in (n for n in WORKLOADS if n in names):
        w = workload(name, s)
        out["workloads"][name] = {
            "label": w.name, "requests": w.requests, "working_set_tokens": w.working_set_tokens,
            "ceiling": round(w.ceiling(), 3),
        }  # fmt: skip
        for policy in list(policies):
            try:
                cell = measure_cell(pool, tmp / name / policy, s, policy, w)
            except Refused as exc:
                out["skipped"][policy] = str(exc)
                policies.remove(policy)
                say(f"fleet: policy {policy} skipped: the edge refused it: {exc}")
                continue
            out["cells"].setdefault(name, {})[policy] = cell
            say(f"fleet: {w.name}, {policy}: {_line(cell)}")
    if "shared" in names:
        out["two_edges"] = two_edges(pool, tmp, s, policies, say)
    return out


def two_edges(
    pool: Pool, tmp: Path, s: FleetSettings, policies: list[str], say: Callable[[str], None]
) -> dict[str, Any]:
    """The shared-prefix workload through two edges in front of the same nodes (requests
    alternating between them), with cache_aware (else the last policy this edge took)."""
    policy = "cache_aware" if "cache_aware" in policies else policies[-1]
    w = workload("shared", s)
    cell = measure_cell(pool, tmp / "two-edges", s, policy, w, count=2)
    say(f"fleet: {w.name}, two edges, {policy}: {_line(cell)}")
    return {"policy": policy, "cell": cell}


def _line(cell: dict[str, Any]) -> str:
    hit = cell.get("hit_ratio")
    return (
        f"hit {'-' if hit is None else f'{hit:.2f}'}, TTFT p50 {cell.get('ttft_p50_ms')} ms, "
        f"{cell.get('req_per_s')} req/s, {cell.get('errors')} errors"
    )
