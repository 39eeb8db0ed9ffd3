"""The fleet benchmark's figures, tables and goals: from the load generator's records to
the printed run. Pure: no process, no I/O (`benchmarks.fleet` and `benchmarks.fleetpeer`
measure; this module only counts and prints).

The goals are the issue's, as ratios of figures of the same run: cache_aware against
least_loaded on each workload, two edges against one, and this edge against SMG's
cache_aware on the same four workers.
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


def _row(label: str, c: dict[str, Any]) -> list[str]:
    share = c.get("busiest_share")
    return [
        label, _hit(c.get("hit_ratio")), fmt(c.get("ttft_p50_ms"), " ms"),
        fmt(c.get("ttft_p99_ms"), " ms"), fmt(c.get("req_per_s")),
        "-" if share is None else f"{share:.0%} ({'/'.join(map(str, c['runs_per_node']))})",
        fmt(c.get("gateway_cpu_us_per_req"), " us"), f"{c.get('errors', 0)}",
    ]  # fmt: skip


HEADERS = [
    "policy", "hit ratio", "TTFT p50", "TTFT p99", "req/s", "busiest node (runs per node)",
    "edge CPU/req", "errors",
]  # fmt: skip


def render_fleet(r: dict[str, Any]) -> list[str]:
    s = r["settings"]
    out = [
        f"Routing over {s['nodes']} simulated nodes, KV cache {s['kv_tokens']:,} tokens each, "
        f"prefill {s['prefill_us_per_token']} us per uncached token, max {s['max_runs']} runs "
        f"per node; {s['concurrency']} requests in flight; fresh nodes and edge per cell"
    ]
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
        rows = [_row(policy, c) for policy, c in cells.items()]
        two = r.get("two_edges")
        if name == "shared" and two:
            rows.append(_row(f"{two['policy']}, two edges", two["cell"]))
        out.append(table(HEADERS, rows))
    peer = r.get("peers")
    if peer:
        out += render_peers(peer)
    out += ["", "Goals (ratios of figures of this run):", table(GOAL_HEADERS, goal_rows(r))]
    return out


def render_peers(p: dict[str, Any]) -> list[str]:
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
            rows = [_row(label, c) for label, c in cells.items()]
            out.append(table(["gateway", *HEADERS[1:6], "gateway CPU/req", "errors"], rows))
    if "error" in p:  # the cells above were measured; the rest were not
        out.append(f"\nBeside SMG: stopped there ({p['error']})")
    return out


GOAL_HEADERS = ["goal", "measured", "met"]


def _cell(r: dict[str, Any], workload: str, policy: str) -> dict[str, Any]:
    found: dict[str, Any] = r.get("cells", {}).get(workload, {}).get(policy) or {}
    return found


def goal_rows(r: dict[str, Any]) -> list[list[str]]:
    rows: list[list[str]] = []

    def add(goal: str, value: float | None, ok: Callable[[float], bool]) -> None:
        met = "-" if value is None else ("yes" if ok(value) else "NO")
        rows.append([goal, "-" if value is None else f"{value:.3g}x", met])

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
    peer = r.get("peers") or {}
    for key, where in (("cells", ""), ("cells_apart", " (gateway on its own CPU)")):
        for name, cells in (peer.get(key) or {}).items():
            edge = cells.get("iop-edge") or {}
            smg = cells.get("SMG") or {}
            label = f"beside SMG{where}, {LABELS.get(name, name)}"
            hits = ratio(edge.get("hit_ratio"), smg.get("hit_ratio"))
            ttft = ratio(edge.get("ttft_p50_ms"), smg.get("ttft_p50_ms"))
            add(f"{label}: hit ratio, edge / SMG >= 1", hits, lambda v: v >= 1)
            add(f"{label}: TTFT p50, edge / SMG <= 1", ttft, lambda v: v <= 1)
    return rows
