"""The main run's result for people: its raw rounds folded into the summary (medians and
ranges beside their same-run baselines), and the summary printed as tables.

Reads only the result dict (`raw`, `settings`, `machine`, `peers`): it must not know how a
figure is measured (`benchmarks.workloads`) or where the result is written
(`benchmarks.cli`). Formatting primitives and the goals are in `benchmarks.report`.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import Settings
from benchmarks.report import diff, dig, fmt, fmt_range, fold, goal_rows, med, ratio, table

# --- summary ------------------------------------------------------------------------------


def summarize(raw: dict[str, Any], s: Settings) -> dict[str, Any]:
    rounds = raw["rounds"]
    out: dict[str, Any] = {
        "calibration_us": fold([{"v": r["calibration_us"]} for r in rounds]).get("v"),
        "ttft": fold([r["ttft"] for r in rounds]),
    }

    def streams(get: Any) -> dict[str, Any]:
        edge = [get(r)["edge"] for r in rounds]
        direct = [get(r)["direct"] for r in rounds]
        derived = [
            {
                "throughput_vs_direct": ratio(e["chunks_per_s"], d["chunks_per_s"]),
                "edge_cpu_in_calibration_units": ratio(
                    e["edge_cpu_us_per_chunk"], r["calibration_us"]
                ),
            }
            for e, d, r in zip(edge, direct, rounds, strict=True)
        ]
        return {"edge": fold(edge), "direct": fold(direct), "vs": fold(derived)}

    out["one_stream"] = streams(lambda r: r["one_stream"])
    out["concurrency"] = {
        f"{c}x{n}": streams(lambda r, k=f"{c}x{n}": r["concurrency"][k]) for c, n in s.concurrency
    }
    out["concurrency_keys"] = [[f"{c}x{n}", c] for c, n in s.concurrency]
    out["nonstream"] = {}
    for rps in s.rates:
        key = f"{rps:g}rps"
        edge = [r["nonstream"][key]["edge"] for r in rounds]
        direct = [r["nonstream"][key]["direct"] for r in rounds]
        added = [
            {
                "added_p50_ms": diff(e["p50_ms"], d["p50_ms"]),
                "added_p99_ms": diff(e["p99_ms"], d["p99_ms"]),
            }
            for e, d in zip(edge, direct, strict=True)
        ]
        out["nonstream"][key] = {"edge": fold(edge), "direct": fold(direct), **fold(added)}
    out["rate_keys"] = [[f"{r:g}rps", r] for r in s.rates]
    out["paced"] = {}
    for count, tps, _ in s.paced:
        key = f"{count}x{tps:g}"
        edge = [r["paced"][key]["edge"] for r in rounds]
        direct = [r["paced"][key]["direct"] for r in rounds]
        derived = [
            {
                "edge_cpu_in_calibration_units": ratio(
                    e.get("edge_cpu_us_per_chunk"), r["calibration_us"]
                ),
                "added_gap_p50_ms": diff(e.get("gap_p50_ms"), d.get("gap_p50_ms")),
                "added_gap_p99_ms": diff(e.get("gap_p99_ms"), d.get("gap_p99_ms")),
                "rate_vs_direct": ratio(e.get("window_chunks_per_s"), d.get("window_chunks_per_s")),
            }
            for e, d, r in zip(edge, direct, rounds, strict=True)
        ]
        out["paced"][key] = {"edge": fold(edge), "direct": fold(direct), "vs": fold(derived)}
    once = raw["once"]
    out["disconnect"] = once.get("disconnect")
    out["client_alone"] = once.get("client_alone")
    out["open_streams"] = once.get("open_streams", {})
    measured = [v for v in out["open_streams"].values() if "opened" in v]
    out["open_streams_first"] = measured[0] if measured else None
    out["open_streams_last"] = measured[-1] if measured else None
    return out


# --- printing -------------------------------------------------------------------------------


def saturated(folded: dict[str, Any]) -> bool:
    value = folded.get("saturated")
    return value is True or (isinstance(value, list) and True in value)


def main_rows(sm: dict[str, Any], s: Settings) -> list[list[str]]:
    """figure | through the edge | baseline (same run) | edge vs baseline."""
    rows: list[list[str]] = []
    t = sm["ttft"]
    rows.append(
        [
            "TTFT p50 (edge vs node client, interleaved)",
            fmt_range(t.get("edge_p50_ms"), " ms"),
            fmt_range(t.get("direct_p50_ms"), " ms"),
            "+" + fmt_range(t.get("added_p50_ms"), " ms"),
        ]
    )
    rows.append(
        [
            "TTFT p99",
            fmt_range(t.get("edge_p99_ms"), " ms"),
            fmt_range(t.get("direct_p99_ms"), " ms"),
            "+" + fmt_range(t.get("added_p99_ms"), " ms"),
        ]
    )
    cal = sm.get("calibration_us")

    def stream_rows(label: str, fig: dict[str, Any]) -> None:
        rows.append(
            [
                f"{label}: chunks/s",
                fmt_range(dig(fig, "edge", "chunks_per_s")),
                fmt_range(dig(fig, "direct", "chunks_per_s")),
                "x" + fmt_range(dig(fig, "vs", "throughput_vs_direct")),
            ]
        )
        cpu = med(dig(fig, "edge", "edge_cpu_us_per_chunk"))
        rows.append(
            [
                f"{label}: edge CPU per chunk",
                fmt_range(dig(fig, "edge", "edge_cpu_us_per_chunk"), " us"),
                f"calibration {fmt(med(cal), ' us')}",
                fmt_range(dig(fig, "vs", "edge_cpu_in_calibration_units"), " units")
                + (f"; one core ~{fmt(1e6 / cpu)} ch/s" if cpu else ""),
            ]
        )

    stream_rows(f"1 x {s.long_chunks}", sm["one_stream"])
    for c, n in s.concurrency:
        stream_rows(f"{c} x {n}", sm["concurrency"][f"{c}x{n}"])
    for count, tps, _ in s.paced:
        fig = (sm.get("paced") or {}).get(f"{count}x{tps:g}")
        if fig:
            paced_rows(rows, f"paced {count} x {tps:g} tok/s", fig, cal)
    for rps in s.rates:
        fig = sm["nonstream"][f"{rps:g}rps"]
        edge = fig["edge"]
        rows.append(
            [
                f"non-stream {rps:g} req/s: p50",
                fmt_range(edge.get("p50_ms"), " ms"),
                fmt_range(dig(fig, "direct", "p50_ms"), " ms"),
                "+" + fmt_range(fig.get("added_p50_ms"), " ms"),
            ]
        )
        rows.append(
            [
                f"non-stream {rps:g} req/s: p99",
                fmt_range(edge.get("p99_ms"), " ms"),
                fmt_range(dig(fig, "direct", "p99_ms"), " ms"),
                "+" + fmt_range(fig.get("added_p99_ms"), " ms"),
            ]
        )
        rows.append(
            [
                f"non-stream {rps:g} req/s: achieved, edge CPU/req",
                f"{fmt_range(edge.get('achieved_rps'), ' req/s')}, "
                f"{fmt_range(edge.get('edge_cpu_us_per_req'), ' us')}",
                fmt_range(dig(fig, "direct", "achieved_rps"), " req/s"),
                "SATURATED (latencies not comparable)" if saturated(edge) else "",
            ]
        )
    dc = sm.get("disconnect") or {}
    rows.append(
        [
            "disconnect -> CancelRun at node p50",
            fmt(dc.get("edge_p50_ms"), " ms"),
            fmt(dc.get("direct_p50_ms"), " ms"),
            "+" + fmt(dc.get("added_p50_ms"), " ms"),
        ]
    )
    rows.append(
        [
            "disconnect -> CancelRun at node p99",
            fmt(dc.get("edge_p99_ms"), " ms"),
            fmt(dc.get("direct_p99_ms"), " ms"),
            "",
        ]
    )
    for key, fig in (sm.get("open_streams") or {}).items():
        if "opened" not in fig:
            rows.append([f"{int(key):,} open streams", "skipped (time budget)", "", ""])
            continue
        rows.append(
            [
                f"{int(key):,} open streams: edge RSS per stream",
                fmt(fig["rss_kib_per_stream"], " KiB"),
                f"idle edge {fmt(fig['rss_before_mib'], ' MiB')}",
                f"total {fmt(fig['rss_with_streams_mib'], ' MiB')}",
            ]
        )
        ended = fig.get("all_ended_on_node_s")
        rows.append(
            [
                f"{int(key):,} open streams: disconnect all -> all ended on node",
                fmt(ended, " s") if ended is not None else "not within the bound",
                "",
                f"CancelRun <= 1 s: {fig['cancel_rpc_in_grace']}/{fig['opened']} "
                f"(p50 {fmt(fig['cancel_p50_ms'], ' ms')}), late {fig['cancel_rpc_late']}, "
                f"gave up {fig['cancel_rpc_gave_up']}",
            ]
        )
        rows.append(
            [
                f"{int(key):,} open streams: opening",
                f"{fmt(fig['opens_per_s'], ' /s')}, edge "
                f"{fmt(fig['edge_cpu_ms_per_open'], ' ms')} CPU each",
                "",
                f"{fig['opened']}/{fig['streams']} opened",
            ]
        )
    return rows


def paced_rows(rows: list[list[str]], label: str, fig: dict[str, Any], cal: Any) -> None:
    """The paced workload: rate, edge CPU per chunk, inter-chunk gaps vs the node client."""
    edge = fig["edge"]
    offered = med(edge.get("offered_chunks_per_s"))
    rows.append(
        [
            f"{label}: chunks/s in the window (offered {fmt(offered)}; window "
            f"{fmt_range(edge.get('window_s'), ' s')})",
            fmt_range(edge.get("window_chunks_per_s")),
            fmt_range(dig(fig, "direct", "window_chunks_per_s")),
            "x"
            + fmt_range(dig(fig, "vs", "rate_vs_direct"))
            + ("; SATURATED" if saturated(edge) else ""),
        ]
    )
    cpu = med(edge.get("edge_cpu_us_per_chunk"))
    rows.append(
        [
            f"{label}: edge CPU per chunk",
            fmt_range(edge.get("edge_cpu_us_per_chunk"), " us"),
            f"calibration {fmt(med(cal), ' us')}",
            fmt_range(dig(fig, "vs", "edge_cpu_in_calibration_units"), " units")
            + (f"; one core ~{fmt(1e6 / cpu)} ch/s" if cpu else ""),
        ]
    )
    for q in ("p50", "p99"):
        rows.append(
            [
                f"{label}: inter-chunk gap {q}",
                fmt_range(edge.get(f"gap_{q}_ms"), " ms"),
                fmt_range(dig(fig, "direct", f"gap_{q}_ms"), " ms"),
                "+" + fmt_range(dig(fig, "vs", f"added_gap_{q}_ms"), " ms"),
            ]
        )


def cpu_rows(sm: dict[str, Any], s: Settings) -> list[list[str]]:
    """CPU per chunk by process: the client and the node must not be the bottleneck."""
    rows: list[list[str]] = []
    figs = (
        [(f"1 x {s.long_chunks}", sm["one_stream"])]
        + [(f"{c} x {n}", sm["concurrency"][f"{c}x{n}"]) for c, n in s.concurrency]
        + [
            (f"paced {c} x {t:g} tok/s", sm["paced"][f"{c}x{t:g}"])
            for c, t, _ in s.paced
            if f"{c}x{t:g}" in (sm.get("paced") or {})
        ]
    )
    for label, fig in figs:
        rows.append(
            [
                label,
                fmt_range(dig(fig, "edge", "edge_cpu_us_per_chunk"), " us"),
                fmt_range(dig(fig, "edge", "node_cpu_us_per_chunk"), " us"),
                fmt_range(dig(fig, "edge", "client_cpu_us_per_chunk"), " us"),
                fmt_range(dig(fig, "edge", "frames_per_write")),
                fmt_range(dig(fig, "direct", "node_cpu_us_per_chunk"), " us"),
                fmt_range(dig(fig, "direct", "client_cpu_us_per_chunk"), " us"),
            ]
        )
    return rows


def client_alone_line(sm: dict[str, Any]) -> str:
    parts = [
        f"{key.split('_')[-1]}: {fmt(fig.get('chunks_per_s'))} ch/s at "
        f"{fmt(fig.get('client_cpu_us_per_chunk'), ' us')}/chunk"
        for key, fig in (sm.get("client_alone") or {}).items()
    ]
    return "load generator alone (replay server, the edge's own frames): " + "; ".join(parts)


def render(result: dict[str, Any]) -> str:
    s = Settings(**result["settings"])
    s.concurrency = [tuple(x) for x in s.concurrency]  # type: ignore[misc]
    s.paced = [tuple(x) for x in s.paced]  # type: ignore[misc]
    sm = result["summary"]
    m = result["machine"]
    lines = [
        "",
        f"iop-edge benchmarks ({'quick' if result['quick'] else 'full'}, "
        f"{len(result['raw']['rounds'])} round(s), {result['elapsed_s']:.0f} s)",
        f"machine: {m['cores']} cores ({m['cpu']}), Python {m['python']}, "
        f"load {m['loadavg_start']} -> {m.get('loadavg_end')}, git {m['git']}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v),
        "Medians over rounds (min..max). Baseline = the same run via the node client "
        "directly (edge.node.client.GrpcNodeClient), same machine, same minute.",
        "",
        table(["figure", "through the edge", "baseline", "edge vs baseline"], main_rows(sm, s)),
        "",
        "CPU per chunk by process (edge runs: edge, node, client; direct runs: node, client)",
        table(
            [
                "workload",
                "edge",
                "node",
                "client",
                "SSE frames/write",
                "node (direct)",
                "client (direct)",
            ],
            cpu_rows(sm, s),
        ),
        client_alone_line(sm),
        "",
        "Goals (issue 7)",
        table(["goal", "measured", "met"], goal_rows(sm)),
    ]
    peer = result.get("peers")
    if peer:
        lines += peer_lines(peer, sm, s)
    return "\n".join(lines)


def peer_lines(peer: dict[str, Any], sm: dict[str, Any], s: Settings) -> list[str]:
    from benchmarks.peer import peer_headers, peer_rows, same_mock_headers, same_mock_rows

    if "error" in peer:
        return ["", f"peer comparison failed: {peer['error']}"]
    versions = peer.get("versions") or {}
    lines = []
    same = same_mock_rows(peer)
    if same:
        lines += [
            "",
            "Same upstream, same client (the peer tool): iop-edge -> iop-node -> mock vs "
            f"LiteLLM ({peer.get('litellm_spec')}) and SMG ({versions.get('smg', 'not run')}) "
            f"-> mock (iop-node CPU {peer.get('iop_node_cpu_s')} s, not in the edge's CPU "
            "figures)",
            table(same_mock_headers(peer), same),
        ]
    rows = peer_rows(peer, sm, s)
    if rows:
        lines += [
            "",
            "The edge's own harness (the simulated node over gRPC) beside the peers on their "
            "mock (HTTP/SSE): different upstreams and clients, trends only",
            table(peer_headers(peer), rows),
        ]
    return lines
