"""The fleet benchmark's figures, tables and goals: from the load generator's records to
the printed run. Pure: no process, no I/O (`benchmarks.fleet` and `benchmarks.fleetpeer`
measure; this module only counts and prints).

The goals are the issue's, as ratios of figures of the same run: cache_aware against
least_loaded on each workload and against the workload's ceiling, two edges against
one, this edge against SMG's cache_aware on the same four workers, and on the
cache-pressure workload (`benchmarks.pressure`) the exact index against the approximate
one and against SMG.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.report import fmt, pct, ratio, sig, table

LABELS = {
    "shared": "shared prefixes",
    "sessions": "agent sessions",
    "hot": "hot prefix",
    "random": "random (control)",
    "pressure": "cache pressure",
}


def figures(raw: dict[str, Any], runs: list[int], cpu_s: float) -> dict[str, Any]:
    """One cell's figures from the job's records, the runs per node and the gateway's CPU."""
    records = raw["records"]
    ok = [r for r in records if "error" not in r]
    errors = [r["error"] for r in records if "error" in r] + raw.get("lane_failures", [])
    prompt = sum(r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None)
    cached = sum(r["cached_tokens"] for r in ok if r.get("cached_tokens") is not None)
    ttfts = [r["ttft_ms"] for r in ok if "ttft_ms" in r]
    total = sum(runs)
    wall = raw["wall_s"]
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(errors) + raw.get("unfinished", 0),
        "first_error": errors[0] if errors else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_ratio": sig(cached / prompt) if prompt else None,
        "ttft_p50_ms": sig(pct(ttfts, 50)) if ttfts else None,
        "ttft_p99_ms": sig(pct(ttfts, 99)) if ttfts else None,
        "req_per_s": sig(len(ok) / wall) if wall > 0 else None,
        "wall_s": sig(wall),
        "runs_per_node": runs,
        "busiest_share": sig(max(runs) / total) if total else None,
        "busiest_vs_mean": sig(max(runs) * len(runs) / total) if total else None,
        "gateway_cpu_us_per_req": sig(cpu_s * 1e6 / len(ok)) if ok else None,
        "client_cpu_s": sig(raw.get("client_cpu_s", 0.0)),
    }


def _hit(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _row(label: str, c: dict[str, Any], ceiling: float | None = None) -> list[str]:
    share = c.get("busiest_share")
    return [
        label, _hit(c.get("hit_ratio")), _hit(ceiling), fmt(c.get("ttft_p50_ms"), " ms"),
        fmt(c.get("ttft_p99_ms"), " ms"), fmt(c.get("req_per_s")),
        "-" if share is None else f"{share:.0%} ({'/'.join(map(str, c['runs_per_node']))})",
        fmt(c.get("gateway_cpu_us_per_req"), " us"), f"{c.get('errors', 0)}",
    ]  # fmt: skip


HEADERS = [
    "policy", "hit ratio", "ceiling", "TTFT p50", "TTFT p99", "req/s",
    "busiest node (runs per node)", "edge CPU/req", "errors",
]  # fmt: skip


def ceilings(r: dict[str, Any]) -> dict[str, float]:
    """Each workload's ceiling: the most of its prompt tokens any cache could have held."""
    found = {name: w.get("ceiling") for name, w in (r.get("workloads") or {}).items()}
    pressure = (r.get("pressure") or {}).get("workload") or {}
    if "ceiling" in pressure:
        found["pressure"] = pressure["ceiling"]
    return {k: v for k, v in found.items() if v is not None}


def render_fleet(r: dict[str, Any]) -> list[str]:
    s = r["settings"]
    out = []
    if r["cells"]:
        out.append(
            f"Routing over {s['nodes']} simulated nodes, KV cache {s['kv_tokens']:,} tokens "
            f"each, prefill {s['prefill_us_per_token']} us per uncached token, max "
            f"{s['max_runs']} runs per node; {s['concurrency']} requests in flight; fresh nodes"
            " and edge per cell"
        )
    if not r.get("kv_model"):
        out.append("(this iop-sim-node has no KV model: nothing is cached, hit ratio 0)")
    for policy, why in r.get("skipped", {}).items():
        out.append(f"policy {policy} skipped: the edge refused it ({why})")
    for name, cells in r["cells"].items():
        w = r["workloads"][name]
        held = w["working_set_tokens"]
        out.append(
            f"\n{LABELS.get(name, name)}: {w['requests']} requests, "
            + (f"working set {held:,} tokens" if held else "nothing to reuse")
            + (f"; at most {w['ceiling']:.0%} of the prompts' text reusable" if held else "")
        )
        rows = [_row(policy, c, w["ceiling"]) for policy, c in cells.items()]
        two = r.get("two_edges")
        if name == "shared" and two:
            rows.append(_row(f"{two['policy']}, two edges", two["cell"], w["ceiling"]))
        out.append(table(HEADERS, rows))
    peer = r.get("peers")
    if peer:
        out += render_peers(peer, ceilings(r))
    if r.get("pressure"):
        out += render_pressure(r["pressure"])
    out += ["", "Goals (ratios of figures of this run):", table(GOAL_HEADERS, goal_rows(r))]
    return out


PRESSURE_HEADERS = [
    "gateway", "hit ratio", "ceiling", "TTFT p50", "TTFT p90", "TTFT p99", "output tok/s",
    "TTFT p90 by stage", "runs per node", "gateway CPU/req", "errors",
]  # fmt: skip


def _pressure_row(label: str, c: dict[str, Any], ceiling: float | None) -> list[str]:
    stages = "/".join(fmt(x) for x in c.get("stage_ttft_p90_ms") or [])
    return [
        label, _hit(c.get("hit_ratio")), _hit(ceiling), fmt(c.get("ttft_p50_ms"), " ms"),
        fmt(c.get("ttft_p90_ms"), " ms"), fmt(c.get("ttft_p99_ms"), " ms"),
        fmt(c.get("output_tok_per_s")), f"{stages} ms" if stages else "-",
        "/".join(map(str, c.get("runs_per_node") or [])),
        fmt(c.get("gateway_cpu_us_per_req"), " us"), f"{c.get('errors', 0)}",
    ]  # fmt: skip


def render_pressure(p: dict[str, Any]) -> list[str]:
    """The cache-pressure workload's tables: the gateway on a CPU of its own, then shared."""
    s, w = p["settings"], p["workload"]
    rates = ", ".join(f"{rate:g}" for rate, _ in s["stages"])
    out = [
        f"\ncache pressure: {w['requests']} requests over {len(s['stages'])} stages of "
        f"{s['stage_s']:g} s at {rates} req/s (Poisson); {s['groups']} system prompts of "
        f"{s['prefix_tokens']:,} tokens, {w['prefix_share']:.0%} of the fleet's KV cache "
        f"({s['nodes']} nodes x {s['kv_tokens']:,} tokens), a question of {s['question_words']}"
        f" words each; nodes: prefill {s['prefill_us_per_token']:g} us a token, decode "
        f"{s['decode_tokens_per_s']:g} tokens/s, {s['max_runs']} runs at once; the fleet serves"
        f" {w['capacity_no_reuse']:g} req/s with nothing reused, {w['capacity_at_ceiling']:g}"
        f" at the ceiling; other traffic {s['other_rate']:g} req/s of {s['other_tokens']:,}"
        f"-token random prompts to {s['other_nodes']} node(s), not through the gateway"
    ]
    titles = {
        "apart": "the gateway on a CPU of its own",
        "shared": "shared cores",
        "replicas": f"{s.get('replicas', 3)} replicas of each gateway, the requests spread"
        " over them in turn, on a CPU of their own",
    }
    for mode, cells in p["cells"].items():
        out.append(f"\ncache pressure, {titles.get(mode, mode)}")
        rows = [_pressure_row(label, c, w.get("ceiling")) for label, c in cells.items()]
        out.append(table(PRESSURE_HEADERS, rows))
    return out


def render_peers(p: dict[str, Any], ceiling: dict[str, float] | None = None) -> list[str]:
    if "settings" not in p:
        return [f"\nBeside SMG: not run ({p.get('error', 'no result')})"]
    s = p["settings"]
    out = [
        f"\nBeside SMG {p.get('smg_version') or ''} (--policy cache_aware): the same workloads "
        f"on {s['nodes']} HTTP workers (each an iop-edge in front of its own simulated node); "
        f"this edge ({p['edge_policy']}) reaches them as openai+http:// nodes (it relays their "
        "runs itself; their Describe and Watch are an iop-node's in its process, in its CPU)"
    ]
    for key, title in (("cells", ""), ("cells_apart", ", the gateway on a CPU of its own")):
        if key == "cells_apart" and p.get(key):
            out.append(
                "\nThe same, with the gateway on a CPU of its own and every other process"
                " (nodes, workers, load generator) on the others, as a gateway runs apart"
                " from its model servers in a deployment"
            )
        for name, cells in (p.get(key) or {}).items():
            out.append(f"\n{LABELS.get(name, name)}{title}")
            rows = [_row(label, c, (ceiling or {}).get(name)) for label, c in cells.items()]
            out.append(table(["gateway", *HEADERS[1:7], "gateway CPU/req", "errors"], rows))
    if "error" in p:  # the cells above were measured; the rest were not
        out.append(f"\nBeside SMG: stopped there ({p['error']})")
    return out


GOAL_HEADERS = ["goal", "measured", "met"]


def _cell(r: dict[str, Any], workload: str, policy: str) -> dict[str, Any]:
    found: dict[str, Any] = r.get("cells", {}).get(workload, {}).get(policy) or {}
    return found


class Goals:
    """The goal rows of a run: goal, measured, met (a goal whose figures the run does not
    have is left out)."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def add(
        self, goal: str, value: float | None, ok: Callable[[float], bool], unit: str = "x"
    ) -> None:
        if value is not None:
            self.rows.append([goal, f"{value:.3g}{unit}", "yes" if ok(value) else "NO"])


def goal_rows(r: dict[str, Any]) -> list[list[str]]:
    goals = Goals()
    _routing_goals(r, goals)
    _ceiling_goals(r, goals)
    _peer_goals(r, goals)
    _pressure_goals(r.get("pressure") or {}, goals)
    return goals.rows


def _routing_goals(r: dict[str, Any], goals: Goals) -> None:
    """cache_aware against least_loaded on each workload; two edges against one."""
    add = goals.add

    def vs(workload: str, key: str, policy: str = "cache_aware", base: str = "least_loaded") -> Any:
        return ratio(_cell(r, workload, policy).get(key), _cell(r, workload, base).get(key))

    for name in ("shared", "sessions"):
        label = LABELS[name]
        # The most any policy could reach over least_loaded on this workload.
        most = ratio(
            (r.get("workloads", {}).get(name) or {}).get("ceiling"),
            _cell(r, name, "least_loaded").get("hit_ratio"),
        )
        bound = "" if most is None else f" (ceiling {most:.3g}x)"
        add(f"{label}: hit ratio, cache_aware / least_loaded >= 3{bound}",
            vs(name, "hit_ratio"), lambda v: v >= 3)  # fmt: skip
        add(f"{label}: TTFT p50, cache_aware / least_loaded <= 1/3", vs(name, "ttft_p50_ms"),
            lambda v: v <= 1 / 3)  # fmt: skip
    add("random: TTFT p50, cache_aware / least_loaded <= 1.05", vs("random", "ttft_p50_ms"),
        lambda v: v <= 1.05)  # fmt: skip
    add("random: req/s, cache_aware / least_loaded >= 0.95", vs("random", "req_per_s"),
        lambda v: v >= 0.95)  # fmt: skip
    add("hot prefix: busiest node / mean share <= 1.5 (cache_aware)",
        _cell(r, "hot", "cache_aware").get("busiest_vs_mean"), lambda v: v <= 1.5)  # fmt: skip
    add("hot prefix: TTFT p99, cache_aware / least_loaded <= 1.2", vs("hot", "ttft_p99_ms"),
        lambda v: v <= 1.2)  # fmt: skip
    two = r.get("two_edges") or {}
    one = _cell(r, "shared", two.get("policy", "cache_aware")).get("hit_ratio")
    add(f"two edges: hit ratio, two / one >= 0.95 ({two.get('policy', '-')})",
        ratio((two.get("cell") or {}).get("hit_ratio"), one), lambda v: v >= 0.95)  # fmt: skip


def _ceiling_goals(r: dict[str, Any], goals: Goals) -> None:
    """The hit ratio goal restated: cache_aware within 0.05 of what any cache could have
    held (the workload's ceiling), on shared prefixes and agent sessions."""
    for name in ("shared", "sessions"):
        ceiling = (r.get("workloads", {}).get(name) or {}).get("ceiling")
        hit = _cell(r, name, "cache_aware").get("hit_ratio")
        short = None if ceiling is None or hit is None else ceiling - hit
        goals.add(f"{LABELS[name]}: hit ratio, ceiling - cache_aware <= 0.05 (ceiling "
                  f"{'-' if ceiling is None else f'{ceiling:.3f}'})", short,
                  lambda v: v <= 0.05, "")  # fmt: skip


def _peer_goals(r: dict[str, Any], goals: Goals) -> None:
    """This edge against SMG on the same workers, on shared cores and with each gateway on
    a CPU of its own (where the TTFT p50 goal is restated: <= SMG's on every workload)."""
    peer = r.get("peers") or {}
    for key, where in (("cells", ""), ("cells_apart", " (gateway on its own CPU)")):
        for name, cells in (peer.get(key) or {}).items():
            edge = cells.get("iop-edge") or {}
            smg = cells.get("SMG") or {}
            label = f"beside SMG{where}, {LABELS.get(name, name)}"
            hits = ratio(edge.get("hit_ratio"), smg.get("hit_ratio"))
            ttft = ratio(edge.get("ttft_p50_ms"), smg.get("ttft_p50_ms"))
            goals.add(f"{label}: hit ratio, edge / SMG >= 1", hits, lambda v: v >= 1)
            goals.add(f"{label}: TTFT p50, edge / SMG <= 1", ttft, lambda v: v <= 1)


EXACT, APPROXIMATE = "cache_aware, exact", "cache_aware, approximate"


def _pressure_goals(p: dict[str, Any], goals: Goals) -> None:
    """The cache-pressure goals: the exact index against the approximate one and against
    SMG, with the gateway on a CPU of its own (the main row), then on shared cores; and
    the TTFT p50 goal beside SMG (the gateway apart) on this workload too."""
    replicas = (p.get("settings") or {}).get("replicas", 3)
    titles = {
        "apart": "gateway on its own CPU",
        "shared": "shared cores",
        "replicas": f"{replicas} gateway replicas",
    }
    for mode, cells in (p.get("cells") or {}).items():
        exact, approx, smg = (cells.get(k) or {} for k in (EXACT, APPROXIMATE, "SMG"))
        label = f"cache pressure ({titles.get(mode, mode)})"

        def of(cell: dict[str, Any], key: str, exact: dict[str, Any] = exact) -> Any:
            return ratio(exact.get(key), cell.get(key))

        goals.add(f"{label}: TTFT p90, exact / approximate <= 1/5", of(approx, "ttft_p90_ms"),
                  lambda v: v <= 0.2)  # fmt: skip
        goals.add(f"{label}: TTFT p90, exact / SMG <= 1/5", of(smg, "ttft_p90_ms"),
                  lambda v: v <= 0.2)  # fmt: skip
        goals.add(f"{label}: output tok/s, exact / SMG >= 1.2", of(smg, "output_tok_per_s"),
                  lambda v: v >= 1.2)  # fmt: skip
        goals.add(f"{label}: hit ratio, exact / SMG >= 1.2", of(smg, "hit_ratio"),
                  lambda v: v >= 1.2)  # fmt: skip
        if mode == "apart":
            goals.add(f"beside SMG (gateway on its own CPU), {LABELS['pressure']}: TTFT p50,"
                      " exact / SMG <= 1", of(smg, "ttft_p50_ms"), lambda v: v <= 1)  # fmt: skip
