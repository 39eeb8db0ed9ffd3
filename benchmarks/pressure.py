"""The cache-pressure workload of `--fleet` (`pressure`): inference-perf's
many-system-prompts shape scaled to the simulated nodes, through four gateways.

The workload (`benchmarks.prompts.pressure`): `groups` system prompts of `prefix_tokens`
whose total is `prefix_share` of the fleet's KV cache (the nodes' `--kv-tokens` added
up), one drawn at random for each request with a short question of its own; requests
sent open-loop (`benchmarks.jobs.fleet`, `fleet_open`) at Poisson arrivals whose rate
rises stage by stage, each stage's rate a multiple (`load`) of what the fleet serves
when nothing is reused (`capacity`). The gateways, each on fresh nodes:

- `least_loaded` (the edge);
- `cache_aware, approximate`: the edge, its nodes started with `--no-kv-reports`, so its
  index of each node is what it routed there (`edge.fleet.cacheindex`);
- `cache_aware, exact`: the edge, its nodes reporting the blocks they store and evict;
- `SMG`: SGLang's gateway (`cache_aware`) in front of the same nodes, each behind an
  HTTP worker as `benchmarks.fleetpeer` puts them (SMG speaks HTTP to its workers).

First with the gateway on a CPU of its own (`cores_apart`: nodes, workers and the load
generator on the other), the deployment's case, then on shared cores. Then (`replicas`)
the approximate index, the exact one and SMG again, each as `replicas` gateways in front
of the same nodes with the requests spread over them in turn, as a load balancer
spreads them over a gateway's replicas; on a CPU of their own, which they share. Each
replica's approximate index (and each SMG's tree) sees only the requests it routed; an
exact index is the nodes' own report, the same in every replica. Figures per
cell: `benchmarks.fleetreport.figures`, with TTFT p90 and output tokens a second (the
answers' completion tokens over the time from the first request to the last answer),
and TTFT p90 per stage.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import sys
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.fleet import BLOCK_TOKENS, edges, sim_nodes
from benchmarks.fleetpeer import smg_gateway, smg_version
from benchmarks.fleetreport import figures
from benchmarks.loadgen import Pool
from benchmarks.prompts import CHARS_PER_TOKEN, Workload, other_traffic, pressure
from benchmarks.report import pct, sig
from benchmarks.stack import can_set_apart, cores_apart, cpu_s

GATEWAYS = ("least_loaded", "cache_aware, approximate", "cache_aware, exact", "SMG")
# Also with the gateway apart: the edge holding the queue itself, each node capped at the
# runs it says it plays at once (`max_runs` from its Describe), as the other fleet
# workloads run; the rows above leave each node's queue to the node (`max_runs = 0`), as
# iop-node in front of vLLM or SGLang does (it reports no cap).
CAPPED = "cache_aware, exact, edge queue"
# Requests wait at each gateway (or worker) for a node slot as long as the run lasts: a
# request shed would leave the figures (an error), not the queue.
QUEUE_CONFIG = """
[admission]
policy = "fifo"
max_queue = 100000
queue_timeout_s = 600
"""


@dataclass(frozen=True)
class PressureSettings:
    nodes: int = 4
    max_runs: int = 8
    groups: int = 32
    prefix_tokens: int = 2048
    question_words: int = 32
    # the share of the fleet's KV cache the system prompts need (llm-d's run: 73%)
    prefix_share: float = 0.73
    prefill_us_per_token: float = 200.0
    decode_tokens_per_s: float = 64.0
    # each stage's rate, as a share of `capacity(1)` (the fleet with every prefix cached),
    # for `stage_s` seconds: past `capacity(0)` (nothing reused) from the third
    load: tuple[float, ...] = (0.3, 0.45, 0.6, 0.75, 0.85)
    stage_s: float = 6.0
    # other traffic: random prompts of `other_tokens` at `other_rate` a second to the first
    # `other_nodes` nodes, through a gateway of its own (0: none)
    other_rate: float = 3.0
    other_tokens: int = 2048
    other_nodes: int = 1
    # the gateways of the `replicas` cells, the requests spread over them in turn (< 2: none)
    replicas: int = 3
    seed: int = 45
    timeout_s: float = 300.0

    @property
    def kv_tokens(self) -> int:
        """Each node's KV cache, in whole blocks: the prompts are `prefix_share` of all."""
        want = self.groups * self.prefix_tokens / (self.prefix_share * self.nodes)
        return -(-int(want) // BLOCK_TOKENS) * BLOCK_TOKENS

    def slot_s(self, prompt_tokens: float, output_tokens: float) -> float:
        """How long a run holds its node's slot: its prefill, then its answer's decode."""
        return (
            prompt_tokens * self.prefill_us_per_token / 1e6
            + output_tokens / self.decode_tokens_per_s
        )

    def capacity(self, cached_share: float = 0.0) -> float:
        """Requests a second the fleet serves when `cached_share` of each prompt's prefix
        is cached (0: nothing reused; 1: every prefix), from the workload's sizes: slots
        over slot time (the other traffic not counted)."""
        question = self.question_words * 5.4 / CHARS_PER_TOKEN  # words of ~4.4 letters
        prompt = self.prefix_tokens * (1 - cached_share) + question
        output = self.question_words * 1.15  # sim-echo: a word, one token; long ones two
        return self.nodes * self.max_runs / self.slot_s(prompt, output)

    @property
    def stages(self) -> tuple[tuple[float, float], ...]:
        base = self.capacity(1.0)
        return tuple((round(base * x, 2), self.stage_s) for x in self.load)

    def node_flags(self, reports: bool = True) -> list[str]:
        flags = [
            "--max-runs", str(self.max_runs), "--kv-tokens", str(self.kv_tokens),
            "--prefill-us-per-token", str(self.prefill_us_per_token),
            "--decode-tokens-per-s", str(self.decode_tokens_per_s),
        ]  # fmt: skip
        return flags if reports else [*flags, "--no-kv-reports"]


QUICK = PressureSettings(groups=16, load=(0.3, 0.6, 0.85), stage_s=4.0, timeout_s=120.0)


def workload(p: PressureSettings) -> Workload:
    return pressure(p.seed, p.groups, p.prefix_tokens, p.question_words, p.stages)


def other(p: PressureSettings) -> Workload:
    seconds = sum(t for _, t in p.stages)
    return other_traffic(p.seed, p.other_rate, seconds, p.other_tokens)


def spread(origin: list[tuple[int, int]], gateways: int) -> list[int]:
    """The target of each request `merged` ordered: the workload's request i goes to
    gateway i mod `gateways` (targets 0..gateways-1), the other traffic to target
    `gateways` (its own gateway)."""
    return [i % gateways if k == 0 else gateways for k, i in origin]


def merged(
    w: Workload, o: Workload
) -> tuple[list[list[bytes]], list[float], list[tuple[int, int]]]:
    """Both workloads' requests in the order they are sent: their bodies, times, and for
    each (0 for `w`, 1 for `o`; its index there), which is also its target."""
    order = sorted(
        [(at, 0, i) for i, at in enumerate(w.arrivals)]
        + [(at, 1, i) for i, at in enumerate(o.arrivals)]
    )
    bodies = [(w if k == 0 else o).sequences[i] for _, k, i in order]
    return bodies, [at for at, _, _ in order], [(k, i) for _, k, i in order]


def stage_p90(raw: dict[str, Any], w: Workload) -> list[float | None]:
    """TTFT p90 of the requests sent in each stage, in ms."""
    ends = list(itertools.accumulate(seconds for _, seconds in w.stages))
    ttfts: list[list[float]] = [[] for _ in ends]
    for r in raw["records"]:
        if "ttft_ms" in r and "error" not in r:
            stage = bisect.bisect_right(ends, w.arrivals[r["seq"]])
            ttfts[min(stage, len(ends) - 1)].append(r["ttft_ms"])
    return [sig(pct(t, 90)) if t else None for t in ttfts]


def pressure_figures(
    raw: dict[str, Any], runs: list[int], cpu: float, w: Workload
) -> dict[str, Any]:
    """`figures` plus TTFT p90, output tokens a second, the load generator's lateness and
    TTFT p90 per stage."""
    cell = figures(raw, runs, cpu)
    ok = [r for r in raw["records"] if "error" not in r]
    ttfts = [r["ttft_ms"] for r in ok if "ttft_ms" in r]
    output = sum(r.get("completion_tokens") or 0 for r in ok)
    span = max((r["end_s"] for r in ok if "end_s" in r), default=0.0)
    late = [r["late_ms"] for r in raw["records"] if "late_ms" in r]
    return {
        **cell,
        "ttft_p90_ms": sig(pct(ttfts, 90)) if ttfts else None,
        "output_tokens": output,
        "output_tok_per_s": sig(output / span) if span > 0 else None,
        "late_p99_ms": sig(pct(late, 99)) if late else None,
        "stage_ttft_p90_ms": stage_p90(raw, w),
    }


def _play(
    pool: Pool,
    gateways: list[tuple[str, int]],
    other_gateway: tuple[str, int],
    w: Workload,
    o: Workload,
    p: PressureSettings,
) -> Any:
    """The workload spread over `gateways` (`spread`) and the other traffic to
    `other_gateway`, in one open loop; the records of the workload's requests, each with
    its index in it."""
    bodies, times, origin = merged(w, o)
    n = len(gateways)
    raw = pool.run(
        "fleet_open", p.timeout_s + 60, targets=[*gateways, other_gateway], sequences=bodies,
        arrivals=times, timeout_s=p.timeout_s, target_of=spread(origin, n),
    )  # fmt: skip
    mine = [{**r, "seq": origin[r["seq"]][1]} for r in raw["records"] if r["target"] < n]
    return {**raw, "records": mine, "other": [r for r in raw["records"] if r["target"] == n]}


def index_kinds(port: int) -> list[str]:
    """The kinds of index (`exact`, `approximate`) the edge on `port` keeps of its nodes, as
    its `/readyz` says (none: not cache_aware, or no answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            nodes = json.loads(resp.read()).get("nodes") or []
    except urllib.error.HTTPError as exc:
        exc.close()  # its connection, now and not when collected
        return []
    except (OSError, ValueError):
        return []
    return sorted({str((n.get("cache") or {}).get("index")) for n in nodes if n.get("cache")})


def routing_outcomes(port: int) -> dict[str, int]:
    """How the edge on `port` chose each run's node under `cache_aware`, from its /metrics
    (`routing_counts`; {}: no answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return routing_counts(resp.read().decode())
    except OSError:
        return {}


def routing_counts(metrics: str) -> dict[str, int]:
    """`iop_edge_cache_routing_total` by outcome (hit, miss, load_bound, ...) from the
    Prometheus text `metrics`, the outcomes never counted left out."""
    out: dict[str, int] = {}
    for line in metrics.splitlines():
        if line.startswith('iop_edge_cache_routing_total{outcome="'):
            labels, value = line.rsplit(" ", 1)
            if float(value):
                out[labels.split('"')[1]] = int(float(value))
    return out


def _replica(where: Path, r: int, replicas: int) -> Path:
    """Where replica `r` of `replicas` keeps its log (one gateway: `where` itself)."""
    if replicas == 1:
        return where
    path = where / f"replica-{r}"
    path.mkdir(exist_ok=True)
    return path


@contextmanager
def _apart(apart: bool, gateway: list[int], rest: list[int]) -> Iterator[bool]:
    with cores_apart(gateway, rest) if apart else nullcontext(False) as done:
        yield done


def measure_cell(
    pool: Pool,
    where: Path,
    p: PressureSettings,
    gateway: str,
    smg: Path | None,
    apart: bool,
    replicas: int = 1,
) -> dict[str, Any]:
    """The workload through one gateway (`replicas` of it, the requests spread over them)
    on fresh nodes (and, for SMG, fresh workers)."""
    where.mkdir(parents=True, exist_ok=True)
    w, o = workload(p), other(p)
    reports = gateway != "cache_aware, approximate"
    (where / "other").mkdir(exist_ok=True)
    with (
        sim_nodes(where, p.nodes, p.node_flags(reports)) as fleet,
        edges(
            where / "other", [fleet.addresses[: p.other_nodes]], "least_loaded", QUEUE_CONFIG
        ) as others,
    ):
        assert fleet.proc is not None
        rest = [os.getpid(), fleet.proc.pid, *pool.pids, *(proc.pid for proc in others.procs)]
        if gateway == "SMG":
            assert smg is not None
            (where / "workers").mkdir(exist_ok=True)
            nodes = [[a] for a in fleet.addresses]
            with (
                edges(where / "workers", nodes, "least_loaded", QUEUE_CONFIG) as workers,
                ExitStack() as gateways,
            ):
                urls = [f"http://127.0.0.1:{port}" for port in workers.ports]
                rest += [proc.pid for proc in workers.procs]
                started = [
                    gateways.enter_context(smg_gateway(smg, _replica(where, r, replicas), urls))
                    for r in range(replicas)
                ]
                pids = [pid for _, pid in started]
                with _apart(apart, pids, rest):
                    c0 = sum(cpu_s(pid) for pid in pids)
                    targets = [("127.0.0.1", port) for port, _ in started]
                    raw = _play(pool, targets, others.targets[0], w, o, p)
                    cpu = sum(cpu_s(pid) for pid in pids) - c0
        else:
            policy = gateway.split(",")[0]
            keys = "" if gateway == CAPPED else "max_runs = 0\n"
            with (
                edges(where, [fleet.addresses] * replicas, policy, QUEUE_CONFIG, keys) as gw,
                _apart(apart, [proc.pid for proc in gw.procs], rest),
            ):
                c0 = gw.cpu()
                raw = _play(pool, gw.targets, others.targets[0], w, o, p)
                cpu = gw.cpu() - c0
                raw["index"] = index_kinds(gw.ports[0])
                routes = sum((Counter(routing_outcomes(port)) for port in gw.ports), Counter())
                raw["routes"] = dict(routes)
        done = [r for r in raw["records"] + raw["other"] if "error" not in r]
        runs = fleet.runs_per_node(len(done))
    return {
        **pressure_figures(raw, runs, cpu, w),
        "index": raw.get("index"),
        "routes": raw.get("routes"),
    }


def measure_pressure(
    pool: Pool,
    tmp: Path,
    p: PressureSettings,
    smg: Path | None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every gateway on the workload, with the gateway on a CPU of its own (`apart`, where
    the machine has two or more), then on shared cores (`shared`)."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    w = workload(p)
    out: dict[str, Any] = {
        "settings": {**asdict(p), "kv_tokens": p.kv_tokens, "stages": p.stages},
        "workload": {
            "requests": w.requests, "working_set_tokens": w.working_set_tokens,
            "fleet_kv_tokens": p.kv_tokens * p.nodes,
            "prefix_share": round(w.working_set_tokens / (p.kv_tokens * p.nodes), 3),
            "ceiling": round(w.ceiling(), 3),
            "capacity_no_reuse": sig(p.capacity()),
            "capacity_at_ceiling": sig(p.capacity(w.ceiling())),
        },
        "smg_version": smg_version(smg) if smg is not None else None, "cells": {},
    }  # fmt: skip
    apart_ok = can_set_apart()
    modes = [("apart", True, 1), ("shared", False, 1)] if apart_ok else [("shared", False, 1)]
    if p.replicas > 1:
        modes.append(("replicas", apart_ok, p.replicas))
    for mode, apart, replicas in modes:
        for gateway in _gateways(mode, apart):
            if gateway == "SMG" and smg is None:
                continue
            where = tmp / "pressure" / mode / gateway
            cell = measure_cell(pool, where, p, gateway, smg, apart, replicas)
            out["cells"].setdefault(mode, {})[gateway] = cell
            say(
                f"fleet: pressure ({mode}), {gateway}: hit {cell['hit_ratio']}, TTFT p50 "
                f"{cell['ttft_p50_ms']} ms, p90 {cell['ttft_p90_ms']} ms, "
                f"{cell['output_tok_per_s']} output tok/s, {cell['errors']} errors"
                + (f", routed {cell['routes']}" if cell.get("routes") else "")
            )
    return out


def _gateways(mode: str, apart: bool) -> tuple[str, ...]:
    """The cells of `mode`: every gateway, with the edge-queue cell when apart; for
    replicas, the two indexes and SMG."""
    if mode == "replicas":
        return GATEWAYS[1:]
    return (*GATEWAYS, CAPPED) if apart else GATEWAYS
