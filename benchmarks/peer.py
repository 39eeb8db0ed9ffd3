"""Optional (`--litellm`): the same workloads through the LiteLLM proxy, side by side.

Runs the shared peer tool (`/work/shared/tools/peer-litellm-bench`, or
`--litellm-tool PATH`) after the edge's own measurements, with matching sizes. The tool
installs `litellm[proxy]` into a venv under `~/.cache` on first use (large: minutes,
hundreds of MB) and measures LiteLLM in front of a raw asyncio OpenAI-compatible mock,
with the mock called directly as its baseline. Its last stdout line is one JSON object;
`peer_rows` lines its figures up with the edge's.

Not like for like: LiteLLM's upstream is an HTTP/1.1 OpenAI mock, the edge's a gRPC
node; the peer tool's client is aiohttp, ours a raw-socket client. Ratios to each
gateway's own direct baseline are the fairer comparison.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.report import dig, fmt, med
from benchmarks.workloads import Settings

DEFAULT_TOOL = Path("/work/shared/tools/peer-litellm-bench")
PEER_TIMEOUT_S = 45 * 60


def run_peer(tool: Path, settings: Settings, quick: bool, log_dir: Path) -> dict[str, Any]:
    """Run the peer tool (bounded); its JSON result, or {"error": ...}."""
    if not tool.exists():
        return {"error": f"{tool} not found"}
    rates = sorted({20.0, 50.0, *settings.rates})
    cmd = [sys.executable, str(tool)]
    if quick:
        cmd.append("--quick")
    else:
        cmd += [
            "--rounds",
            str(settings.rounds),
            "--ttft-samples",
            str(settings.ttft_samples),
            "--long-chunks",
            str(settings.long_chunks),
            "--idle-streams",
            str(min(settings.open_streams, default=1000)),
            "--rates",
            ",".join(f"{r:g}" for r in rates),
            "--rate-seconds",
            f"{settings.rate_seconds:g}",
        ]
    log = log_dir / "peer-litellm.log"
    try:
        with log.open("wb") as err:
            proc = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=err, timeout=PEER_TIMEOUT_S, check=False
            )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {PEER_TIMEOUT_S} s; log: {log}"}
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}; log: {log}"}
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"error": f"no JSON on the last line; log: {log}"}
    return result


def peer_rows(peer: dict[str, Any], summary: dict[str, Any], settings: Settings) -> list[list[str]]:
    """Rows: figure | iop-edge | LiteLLM | LiteLLM's upstream alone."""
    name = next((k for k in peer if re.fullmatch(r"litellm_w\d+", k)), None)
    if name is None:
        return []
    lite = peer.get(name) or {}
    vs = peer.get(name + "_vs_direct") or {}
    direct = peer.get("direct") or {}
    rows: list[list[str]] = []

    def add(
        label: str, ours: float | None, theirs: float | None, base: float | None, unit: str
    ) -> None:
        rows.append([label, fmt(ours, unit), fmt(theirs, unit), fmt(base, unit)])

    add(
        "added TTFT p50",
        med(dig(summary, "ttft", "added_p50_ms")),
        med(vs.get("ttft_p50_added_ms")),
        None,
        " ms",
    )
    add(
        "added TTFT p99",
        med(dig(summary, "ttft", "added_p99_ms")),
        med(vs.get("ttft_p99_added_ms")),
        None,
        " ms",
    )
    long_key = next((k for k in lite if k.startswith("stream_1x")), None)
    if long_key:
        add(
            f"one stream ({long_key[7:]}) chunks/s",
            med(dig(summary, "one_stream", "edge", "chunks_per_s")),
            med(dig(lite, long_key, "chunks_per_s")),
            med(dig(direct, long_key, "chunks_per_s")),
            "",
        )
        add(
            "  server CPU per chunk",
            med(dig(summary, "one_stream", "edge", "edge_cpu_us_per_chunk")),
            med(dig(lite, long_key, "server_cpu_us_per_chunk")),
            med(dig(direct, long_key, "server_cpu_us_per_chunk")),
            " us",
        )
    for key in ("100x200", "1000x20"):
        if f"stream_{key}" in lite:
            add(
                f"{key} streams chunks/s",
                med(dig(summary, "concurrency", key, "edge", "chunks_per_s")),
                med(dig(lite, f"stream_{key}", "chunks_per_s")),
                med(dig(direct, f"stream_{key}", "chunks_per_s")),
                "",
            )
    for rps in sorted({20.0, 50.0, *settings.rates}):
        key = f"nonstream_{rps:g}rps"
        if key not in lite:
            continue
        ours = dig(summary, "nonstream", f"{rps:g}rps")
        add(
            f"non-stream {rps:g} req/s: p99",
            med(dig(ours, "edge", "p99_ms")),
            med(dig(lite, key, "p99_ms")),
            med(dig(direct, key, "p99_ms")),
            " ms",
        )
        if "skipped" in (lite.get(key) or {}):
            rows[-1][2] = str(lite[key]["skipped"])
    last = summary.get("open_streams_last") or {}
    add(
        f"RSS per open stream (ours at {last.get('opened', 0):,})",
        med(last.get("rss_kib_per_stream")),
        med(dig(lite, "idle_streams", "rss_kib_per_stream")),
        None,
        " KiB",
    )
    add(
        "disconnect -> upstream end p50",
        med(dig(summary, "disconnect", "edge_p50_ms")),
        med(dig(lite, "disconnect", "steady", "upstream_end_after_ms")),
        None,
        " ms",
    )
    return rows
