"""Optional (`--peers`): the same workloads through LiteLLM and SMG, side by side.

Runs the shared peer tool `peer-bench`, found relative to the repository
(`../shared/tools/peer-bench`, or `--peer-tool PATH`), after the edge's own
measurements, with matching sizes. The tool installs `litellm[proxy]` into a venv under
`~/.cache` on first use (large: minutes, hundreds of MB) and measures LiteLLM in front
of a raw asyncio OpenAI-compatible mock, with the mock called directly as its baseline.
With `--smg BIN` it also starts SGLang's model gateway (SMG, a Rust gateway that relays
bytes) in front of the same mock; `smg_binary` installs a pinned `smg` into a venv of
its own (`~/.cache/iop-edge/smg-venv`) when no BIN is given. The tool's last stdout line
is one JSON object; `same_mock_rows` and `peer_rows` line its figures up.

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
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cleanup import child_options, stop
from benchmarks.harness import Settings
from benchmarks.report import dig, fmt, med
from benchmarks.stack import (
    EDGE_CONFIG,
    Probe,
    free_port,
    get_status,
    spawn,
    stop_process,
    venv_script,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOOL = ROOT.parent / "shared" / "tools" / "peer-bench"
PEER_TIMEOUT_S = 45 * 60
# The tool stops each gateway it started within 20 s (SIGTERM, then SIGKILL).
PEER_STOP_S = 60.0
# SGLang's model gateway, pinned: its CLI and its startup (/v1/models) are what the peer
# tool drives. A venv of its own: it must not touch the project's dependencies.
SMG_SPEC = "smg==1.13.0"
SMG_VENV = Path.home() / ".cache" / "iop-edge" / "smg-venv"
SMG_INSTALL_TIMEOUT_S = 15 * 60
GATEWAYS = (("LiteLLM", r"litellm_w\d+"), ("SMG", r"smg"))


EDGE_TARGET = "iop-edge"


def _start_edge_for_mock(
    mock_port: int, log_dir: Path, procs: list[subprocess.Popen[bytes]]
) -> tuple[str, int]:
    """iop-node (model `mock`, upstream the tool's mock) and an iop-edge in front of it,
    added to `procs` (the edge, then the node) as they start; the edge's URL and pid."""
    node_port, edge_port = free_port(), free_port()
    node = spawn(
        [venv_script("iop-node"), "--listen", f"127.0.0.1:{node_port}",
         "--upstream", f"http://127.0.0.1:{mock_port}/v1", "--models", "mock"],
        log_dir / "peer-iop-node.log",
    )  # fmt: skip
    config = log_dir / "peer-edge.toml"
    config.write_text(
        EDGE_CONFIG.format(port=edge_port, name="mock", node=f"127.0.0.1:{node_port}")
    )
    procs.append(node)
    edge = spawn(
        [venv_script("iop-edge"), "--config", str(config), "--log-level", "WARNING"],
        log_dir / "peer-edge.log",
    )
    procs.insert(0, edge)
    url = f"http://127.0.0.1:{edge_port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and get_status(url + "/healthz") != 200:
        if edge.poll() is not None or node.poll() is not None:
            break
        time.sleep(0.1)
    return url, edge.pid


def smg_binary(venv: Path = SMG_VENV) -> Path:
    """The `smg` executable of the pinned venv, created and filled on first use (bounded)."""
    smg = venv / "bin" / "smg"
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import importlib.metadata as m; print(m.version('smg'))"]
    if smg.exists() and python.exists():
        found = subprocess.run(check, capture_output=True, text=True, timeout=60, check=False)
        if found.stdout.strip() == SMG_SPEC.split("==")[1]:
            return smg
    print(f"installing {SMG_SPEC} into {venv} (first use)...", file=sys.stderr)
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", SMG_SPEC],
        check=True,
        timeout=SMG_INSTALL_TIMEOUT_S,
    )
    if not smg.exists():
        raise RuntimeError(f"{SMG_SPEC} installed no `smg` executable in {venv}")
    return smg


def run_peer(
    tool: Path, settings: Settings, quick: bool, log_dir: Path, smg: Path | None = None
) -> dict[str, Any]:
    """Run the peer tool (bounded) with the edge as a target; its JSON, or {"error": ...}."""
    if not tool.exists():
        return {"error": f"{tool} not found (the peer tool lives in ../shared/tools)"}
    rates = sorted({20.0, 50.0, *settings.rates})
    mock_port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        edge_url, edge_pid = _start_edge_for_mock(mock_port, log_dir, procs)
        node_probe = Probe(procs[1].pid)
        node_cpu_start = node_probe.cpu()
        result = _run_tool(
            tool, settings, quick, log_dir, rates, mock_port, edge_url, edge_pid, smg
        )
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
    smg: Path | None,
) -> dict[str, Any]:
    cmd = [
        sys.executable, str(tool), "--mock-port", str(mock_port),
        "--target", f"{EDGE_TARGET}={edge_url},{edge_pid}",
    ]  # fmt: skip
    if smg is not None:
        cmd += ["--smg", str(smg)]
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
    log = log_dir / "peer-bench.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, **child_options())
    try:
        stdout, _ = proc.communicate(timeout=PEER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {PEER_TIMEOUT_S} s; log: {log}"}
    finally:
        # On a Ctrl-C the tool stops its gateways and removes its directory itself.
        stop(proc, signal.SIGINT, PEER_STOP_S)
    lines = [ln for ln in stdout.decode(errors="replace").splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}; log: {log}"}
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"error": f"no JSON on the last line; log: {log}"}
    return result


def _size(key: str) -> tuple[float, ...]:
    """Numeric sort key of "stream_100x200" or "nonstream_50rps"."""
    return tuple(float(x) for x in re.findall(r"\d+(?:\.\d+)?", key))


def _saturated(value: Any) -> bool:
    """The tool's flag: a bool, or per-round values that differed (as strings)."""
    if isinstance(value, list):
        return any(v is True or v == "True" for v in value)
    return value is True


def gateways(peer: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, result key) of every peer gateway the tool measured, LiteLLM first."""
    out = []
    for label, pattern in GATEWAYS:
        key = next((k for k in peer if re.fullmatch(pattern, k)), None)
        if key is not None and isinstance(peer.get(key), dict):
            out.append((label, key))
    return out


def same_mock_headers(peer: dict[str, Any]) -> list[str]:
    return ["figure", "iop-edge + iop-node", *(label for label, _ in gateways(peer)), "mock alone"]


def same_mock_rows(peer: dict[str, Any]) -> list[list[str]]:
    """Rows: figure | iop-edge (via iop-node) | each peer | the mock alone, all from the tool."""
    names = [key for _, key in gateways(peer)]
    edge = peer.get(EDGE_TARGET) or {}
    if not names or not edge:
        return []
    targets = [edge, *(peer.get(n) or {} for n in names), peer.get("direct") or {}]
    vs = [peer.get(k + "_vs_direct") or {} for k in (EDGE_TARGET, *names)]
    rows: list[list[str]] = []

    def add(label: str, key: tuple[str, ...], unit: str, vs_key: str | None = None) -> None:
        if vs_key is not None:
            values = [*(med(v.get(vs_key)) for v in vs), None]
        else:
            values = [med(dig(t, *key)) for t in targets]
        rows.append([label, *(fmt(v, unit) for v in values)])

    add("added TTFT p50", (), " ms", "ttft_p50_added_ms")
    add("added TTFT p99", (), " ms", "ttft_p99_added_ms")
    direct = targets[-1]
    for key in sorted((k for k in direct if k.startswith("stream_")), key=_size):
        add(f"{key[7:]} chunks/s", (key, "chunks_per_s"), "")
        add(f"  {key[7:]} server CPU per chunk", (key, "server_cpu_us_per_chunk"), " us")
    for key in sorted((k for k in direct if k.startswith("nonstream_")), key=_size):
        add(f"non-stream {key[10:]}: p99", (key, "p99_ms"), " ms")
        for i, t in enumerate(targets):
            fig = t.get(key) or {}
            if "skipped" in fig:
                rows[-1][1 + i] = str(fig["skipped"])
            elif _saturated(fig.get("saturated")):
                rows[-1][1 + i] += " (saturated)"
        add(f"  {key[10:]}: server CPU per request", (key, "server_cpu_ms_per_req"), " ms")
    add("RSS per open stream", ("idle_streams", "rss_kib_per_stream"), " KiB")
    add("disconnect -> upstream end", ("disconnect", "steady", "upstream_end_after_ms"), " ms")
    return rows


def peer_headers(peer: dict[str, Any]) -> list[str]:
    labels = [label for label, _ in gateways(peer)]
    return ["figure", "iop-edge (sim node, gRPC)", *labels, "their mock alone"]


def peer_rows(peer: dict[str, Any], summary: dict[str, Any], settings: Settings) -> list[list[str]]:
    """Rows: figure | iop-edge (its own harness) | each peer | the peers' upstream alone."""
    names = [key for _, key in gateways(peer)]
    if not names:
        return []
    peers = [peer.get(n) or {} for n in names]
    vs = [peer.get(n + "_vs_direct") or {} for n in names]
    direct = peer.get("direct") or {}
    rows: list[list[str]] = []

    def add(label: str, ours: Any, theirs: list[Any], base: Any, unit: str) -> None:
        rows.append([label, fmt(ours, unit), *(fmt(t, unit) for t in theirs), fmt(base, unit)])

    for q in ("p50", "p99"):
        add(
            f"added TTFT {q}",
            med(dig(summary, "ttft", f"added_{q}_ms")),
            [med(v.get(f"ttft_{q}_added_ms")) for v in vs],
            None,
            " ms",
        )
    long_key = next((k for k in peers[0] if k.startswith("stream_1x")), None)
    if long_key:
        add(
            f"one stream ({long_key[7:]}) chunks/s",
            med(dig(summary, "one_stream", "edge", "chunks_per_s")),
            [med(dig(p, long_key, "chunks_per_s")) for p in peers],
            med(dig(direct, long_key, "chunks_per_s")),
            "",
        )
        add(
            "  server CPU per chunk",
            med(dig(summary, "one_stream", "edge", "edge_cpu_us_per_chunk")),
            [med(dig(p, long_key, "server_cpu_us_per_chunk")) for p in peers],
            med(dig(direct, long_key, "server_cpu_us_per_chunk")),
            " us",
        )
    for key in ("100x200", "1000x20"):
        if f"stream_{key}" in peers[0]:
            add(
                f"{key} streams chunks/s",
                med(dig(summary, "concurrency", key, "edge", "chunks_per_s")),
                [med(dig(p, f"stream_{key}", "chunks_per_s")) for p in peers],
                med(dig(direct, f"stream_{key}", "chunks_per_s")),
                "",
            )
    for rps in sorted({20.0, 50.0, *settings.rates}):
        key = f"nonstream_{rps:g}rps"
        if key not in peers[0]:
            continue
        ours = dig(summary, "nonstream", f"{rps:g}rps")
        add(
            f"non-stream {rps:g} req/s: p99",
            med(dig(ours, "edge", "p99_ms")),
            [med(dig(p, key, "p99_ms")) for p in peers],
            med(dig(direct, key, "p99_ms")),
            " ms",
        )
        for i, p in enumerate(peers):
            if "skipped" in (p.get(key) or {}):
                rows[-1][2 + i] = str(p[key]["skipped"])
    last = summary.get("open_streams_last") or {}
    add(
        f"RSS per open stream (ours at {last.get('opened', 0):,})",
        med(last.get("rss_kib_per_stream")),
        [med(dig(p, "idle_streams", "rss_kib_per_stream")) for p in peers],
        None,
        " KiB",
    )
    add(
        "disconnect -> upstream end p50",
        med(dig(summary, "disconnect", "edge_p50_ms")),
        [med(dig(p, "disconnect", "steady", "upstream_end_after_ms")) for p in peers],
        None,
        " ms",
    )
    return rows
