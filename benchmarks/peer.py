"""Optional (`--litellm`): the same workloads through the LiteLLM proxy, side by side.

Runs the shared peer tool (`/work/shared/tools/peer-litellm-bench`, or
`--litellm-tool PATH`) after the edge's own measurements, with matching sizes. The tool
installs `litellm[proxy]` into a venv under `~/.cache` on first use (large: minutes,
hundreds of MB) and measures LiteLLM in front of a raw asyncio OpenAI-compatible mock,
with the mock called directly as its baseline. Its last stdout line is one JSON object;
`peer_rows` lines its figures up with the edge's.

The edge is also put in front of the same mock, as a `--target` of the tool:
`iop-edge -> iop-node -> mock` (iop-node is the edge's node for OpenAI-compatible
servers), so both gateways are measured by one client, on one upstream, in one run.
Not like for like even so: the edge's path has a second process (iop-node) and one
more hop (gRPC), and the tool's CPU figure for the edge counts the edge process only
(iop-node's CPU is reported beside it). The edge's own tables (the simulated node over
gRPC, a raw-socket client) are not comparable with the tool's figures.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.report import dig, fmt, med
from benchmarks.stack import EDGE_CONFIG, Probe, _get, _spawn, free_port, stop_process, venv_script
from benchmarks.workloads import Settings

DEFAULT_TOOL = Path("/work/shared/tools/peer-litellm-bench")
PEER_TIMEOUT_S = 45 * 60


EDGE_TARGET = "iop-edge"


def _start_edge_for_mock(
    mock_port: int, log_dir: Path
) -> tuple[list[subprocess.Popen[bytes]], str, int]:
    """iop-node (model `mock`, upstream the tool's mock) and an iop-edge in front of it."""
    node_port, edge_port = free_port(), free_port()
    node = _spawn(
        [venv_script("iop-node"), "--listen", f"127.0.0.1:{node_port}",
         "--upstream", f"http://127.0.0.1:{mock_port}/v1", "--models", "mock"],
        log_dir / "peer-iop-node.log",
    )  # fmt: skip
    config = log_dir / "peer-edge.toml"
    config.write_text(
        EDGE_CONFIG.format(port=edge_port, name="mock", node=f"127.0.0.1:{node_port}")
    )
    edge = _spawn(
        [venv_script("iop-edge"), "--config", str(config), "--log-level", "WARNING"],
        log_dir / "peer-edge.log",
    )
    url = f"http://127.0.0.1:{edge_port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _get(url + "/healthz") != 200:
        if edge.poll() is not None or node.poll() is not None:
            break
        time.sleep(0.1)
    return [edge, node], url, edge.pid


def run_peer(tool: Path, settings: Settings, quick: bool, log_dir: Path) -> dict[str, Any]:
    """Run the peer tool (bounded) with the edge as a target; its JSON, or {"error": ...}."""
    if not tool.exists():
        return {"error": f"{tool} not found"}
    rates = sorted({20.0, 50.0, *settings.rates})
    mock_port = free_port()
    procs, edge_url, edge_pid = _start_edge_for_mock(mock_port, log_dir)
    node_probe = Probe(procs[1].pid)
    node_cpu_start = node_probe.cpu()
    try:
        result = _run_tool(tool, settings, quick, log_dir, rates, mock_port, edge_url, edge_pid)
        result["iop_node_cpu_s"] = round(node_probe.cpu() - node_cpu_start, 2)
        return result
    finally:
        for proc in procs:
            stop_process(proc)


def _run_tool(
    tool: Path,
    settings: Settings,
    quick: bool,
    log_dir: Path,
    rates: list[float],
    mock_port: int,
    edge_url: str,
    edge_pid: int,
) -> dict[str, Any]:
    cmd = [
        sys.executable, str(tool), "--mock-port", str(mock_port),
        "--target", f"{EDGE_TARGET}={edge_url},{edge_pid}",
    ]  # fmt: skip
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


def same_mock_rows(peer: dict[str, Any]) -> list[list[str]]:
    """Rows: figure | iop-edge (via iop-node) | LiteLLM | the mock alone, all from the tool."""
    name = next((k for k in peer if re.fullmatch(r"litellm_w\d+", k)), None)
    edge = peer.get(EDGE_TARGET) or {}
    if name is None or not edge:
        return []
    lite = peer.get(name) or {}
    direct = peer.get("direct") or {}
    vs_edge = peer.get(EDGE_TARGET + "_vs_direct") or {}
    vs_lite = peer.get(name + "_vs_direct") or {}
    rows: list[list[str]] = []

    def add(label: str, key: tuple[str, ...], unit: str, vs_key: str | None = None) -> None:
        if vs_key is not None:
            values = [med(vs_edge.get(vs_key)), med(vs_lite.get(vs_key)), None]
        else:
            values = [med(dig(t, *key)) for t in (edge, lite, direct)]
        rows.append([label, *(fmt(v, unit) for v in values)])

    add("added TTFT p50", (), " ms", "ttft_p50_added_ms")
    add("added TTFT p99", (), " ms", "ttft_p99_added_ms")
    for key in sorted(k for k in direct if k.startswith("stream_")):
        add(f"{key[7:]} chunks/s", (key, "chunks_per_s"), "")
        add(f"  {key[7:]} server CPU per chunk", (key, "server_cpu_us_per_chunk"), " us")
    for key in sorted(k for k in direct if k.startswith("nonstream_")):
        add(f"non-stream {key[10:]}: p99", (key, "p99_ms"), " ms")
    add("RSS per open stream", ("idle_streams", "rss_kib_per_stream"), " KiB")
    add("disconnect -> upstream end", ("disconnect", "steady", "upstream_end_after_ms"), " ms")
    return rows


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
