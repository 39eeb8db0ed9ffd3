"""The cost of nodes found by DNS: an idle edge's CPU with 100 nodes behind one name.

What an edge spends to look its nodes up again and again, with no request running: 100
node connections (one `iop-sim-node --nodes 100` process serves them all, each a node of
its own with its own port), known to the edge three ways, each on a fresh set of
processes:

- `static list`: 100 `[[nodes]]` entries with addresses: what the edge pays to know its
  nodes at all (their Watch streams), the baseline;
- `DNS every 5 s`: one entry, `discover = "dns+srv://..."` with the default
  `discover_interval_s` = 5 s, its SRV name giving the same 100 nodes;
- `DNS every 0.1 s`: the same name looked up 50 times as often, so that the cost of one
  look-up stands out of the noise: (its CPU - the static list's) / look-ups.

The DNS server is `tools.dnszone` (dnslib) in a process of its own on 127.0.0.1: its SRV
answer holds the 100 records and their addresses, too large for UDP, so each look-up is
a UDP query, then a TCP one, as with a cluster's DNS for a large Service. Every answer
is the same: the figure is the look-up and the comparison of 100 nodes with the ones
the edge has, not the churn (tests/integration/test_discovery_e2e.py is the churn).

CPU time is read from the kernel's per-thread scheduler statistics (`cpu_s`), over a
quiet window once every node is up. Rounds alternate the modes (one round by default);
with several, each figure is their median with their range.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import fmt, median_span, sig, table
from benchmarks.stack import (
    Probe,
    cpu_s,
    free_port,
    get_status,
    spawn,
    stop_process,
    up_nodes,
    venv_script,
)

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 60.0
SRV_NAME = "_grpc._tcp.bench.test"


@dataclass(frozen=True)
class Mode:
    label: str
    interval_s: float | None  # None: a static list


MODES = (Mode("static list", None), Mode("DNS every 5 s", 5.0), Mode("DNS every 0.1 s", 0.1))


@dataclass(frozen=True)
class DiscoverySettings:
    nodes: int = 100
    rounds: int = 1
    # Two intervals of the default look-up: a window of one would hold one look-up or two,
    # by where it starts.
    seconds: float = 10.0
    settle_s: float = 2.0


QUICK = DiscoverySettings(seconds=5.0, settle_s=1.0)

EDGE_CONFIG = """\
[server]
listen = "127.0.0.1:{port}"
drain_timeout_s = 2

[log]
level = "WARNING"
"""


def _wait_lines(log: Path, count: int, proc: Any, what: str) -> list[str]:
    """The first `count` "listening on" lines of a process's log, once it wrote them."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        lines = [x for x in log.read_text(errors="replace").splitlines() if "listening on" in x]
        if len(lines) >= count:
            return lines[:count]
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited: {log.read_text()[-500:]}")
        time.sleep(0.05)
    raise SystemExit(f"{what} did not start in time")


def _nodes_config(mode: Mode, ports: list[int], dns_port: int) -> str:
    if mode.interval_s is None:
        return "".join(
            f'\n[[nodes]]\nname = "bench/127.0.0.1:{p}"\naddress = "127.0.0.1:{p}"\n' for p in ports
        )
    return (
        f'\n[discovery]\nnameservers = ["127.0.0.1:{dns_port}"]\n'
        f'\n[[nodes]]\nname = "bench"\ndiscover = "dns+srv://{SRV_NAME}"\n'
        f"discover_interval_s = {mode.interval_s}\n"
    )


def _zone(where: Path, ports: list[int]) -> Path:
    """The zone file: `SRV_NAME` gives every port, each under a target name of its own."""
    zone = {
        "srv": {SRV_NAME: [[f"n{p}.bench.test", p] for p in ports]},
        "addresses": {f"n{p}.bench.test": ["127.0.0.1"] for p in ports},
    }
    path = where / "zone.json"
    path.write_text(json.dumps(zone))
    return path


def _measure_one(tmp: Path, mode: Mode, s: DiscoverySettings) -> dict[str, Any]:
    where = tmp / mode.label.replace(" ", "-")
    where.mkdir(parents=True, exist_ok=True)
    n = s.nodes
    flags = ["--nodes", str(n), "--listen", "127.0.0.1:0", "--name", "bench"]
    sim = spawn([venv_script("iop-sim-node"), *flags], where / "sim.log")
    dns = edge = None
    try:
        lines = _wait_lines(where / "sim.log", n, sim, "iop-sim-node")
        ports = [int(x.rsplit(":", 1)[-1]) for x in lines]
        dns = spawn(
            [sys.executable, "-m", "tools.dnszone", str(_zone(where, ports))],
            where / "dns.log", cwd=ROOT,
        )  # fmt: skip
        dns_port = int(_wait_lines(where / "dns.log", 1, dns, "tools.dnszone")[0].rsplit(":")[-1])
        port = free_port()
        config = EDGE_CONFIG.format(port=port) + _nodes_config(mode, ports, dns_port)
        (where / "config.toml").write_text(config)
        command = [venv_script("iop-edge"), "--config", str(where / "config.toml")]
        edge = spawn(command, where / "edge.log")
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while get_status(base + "/readyz") != 200 or up_nodes(base) < n:
            if edge.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the edge did not see its {n} nodes up in time: "
                                 f"{(where / 'edge.log').read_text()[-800:]}")  # fmt: skip
            time.sleep(0.1)
        time.sleep(s.settle_s)
        e0, t0 = cpu_s(edge.pid), time.monotonic()
        time.sleep(s.seconds)
        e1, t1 = cpu_s(edge.pid), time.monotonic()
        wall = t1 - t0
        return {
            "mode": mode.label, "nodes": n, "wall_s": sig(wall), "up_after": up_nodes(base),
            "edge_core_pct": sig((e1 - e0) * 100 / wall),
            "edge_ms_per_s": sig((e1 - e0) * 1e3 / wall),
            "lookups_per_s": 0.0 if mode.interval_s is None else sig(1 / mode.interval_s),
            "edge_rss_mb": sig(Probe(edge.pid).rss() / 2**20),
        }  # fmt: skip
    finally:
        stop_process(edge)
        stop_process(dns)
        stop_process(sim)


def measure_discovery(
    tmp: Path, s: DiscoverySettings, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every mode, alternating within each round; the cost of one look-up from the
    fastest mode's CPU over the static list's."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    runs: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(s.rounds):
        for mode in MODES:
            r = _measure_one(tmp / f"round-{rnd}", mode, s)
            runs.setdefault(mode.label, []).append(r)
            say(f"discovery: {mode.label}, {s.nodes} nodes: {r['edge_ms_per_s']} ms edge CPU per s")
    rows = [
        {
            "mode": label, "nodes": s.nodes,
            "edge_ms_per_s": [r["edge_ms_per_s"] for r in rs],
            "edge_core_pct": [r["edge_core_pct"] for r in rs],
            "lookups_per_s": rs[0]["lookups_per_s"],
            "edge_rss_mb": [r["edge_rss_mb"] for r in rs],
            "up_after": min(r["up_after"] for r in rs),
        }
        for label, rs in runs.items()
    ]  # fmt: skip
    static = statistics.median(rows[0]["edge_ms_per_s"])
    fastest = rows[-1]
    extra = statistics.median(fastest["edge_ms_per_s"]) - static
    per_lookup_ms = sig(extra / fastest["lookups_per_s"])
    return {"settings": s.__dict__, "rows": rows, "lookup_ms": per_lookup_ms}


HEADERS = (
    "how the edge knows its nodes",
    "look-ups per s",
    "edge CPU, ms per s",
    "edge, % of a core",
    "added to the static list, ms per s",
    "edge RSS MB",
    "up",
)


def _figure(values: list[float]) -> str:
    """The median of a figure's rounds, with their range when there are several."""
    return median_span(values) if len(values) > 1 else fmt(values[0])


def render_discovery(r: dict[str, Any]) -> list[str]:
    s = r["settings"]
    static = statistics.median(r["rows"][0]["edge_ms_per_s"])
    rows = []
    for row in r["rows"]:
        added = statistics.median(row["edge_ms_per_s"]) - static
        rows.append([
            row["mode"], f"{row['lookups_per_s']:g}", _figure(row["edge_ms_per_s"]),
            _figure(row["edge_core_pct"]), "-" if not row["lookups_per_s"] else fmt(added),
            fmt(statistics.median(row["edge_rss_mb"])), f"{row['up_after']}/{row['nodes']}",
        ])  # fmt: skip
    lookup = r["lookup_ms"]
    return [
        f"Nodes found by DNS, idle edge, {s['nodes']} nodes behind one SRV name ({s['rounds']}"
        f" round(s) of {s['seconds']} s per mode, modes alternating; one iop-sim-node process"
        " serves every node, tools.dnszone the name)",
        table(HEADERS, rows),
        f"One look-up of the 100-node name and its comparison with the pool: {fmt(lookup)} ms"
        f" of edge CPU (from the 0.1 s mode); at the default 5 s: {fmt(lookup / 5)} ms per s.",
    ]
