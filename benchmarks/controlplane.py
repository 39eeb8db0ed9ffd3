"""Control-plane cost at fleet scale: the edge's CPU per node, Watch against Describe polling.

What an edge spends to know its nodes, with no request running: for N = 10,
100 and 300 node connections (one `iop-sim-node --nodes N` process serves
them all, each a node of its own with its own name and port), the edge's CPU
over a quiet window once every node is up, divided by N and by the window:
microseconds of edge CPU per node per second. Three ways to learn a node's
state, each on a fresh pair of processes:

- `watch`: the node pushes its state on the Watch stream when it changes and
  at a heartbeat (the edge's default, 2 s); the edge subscribes once per node.
- `watch, all busy`: the same with a heartbeat of 0.1 s, the most a node
  reports (one report per 100 ms however often its state changes): what a
  fleet whose every node changes all the time costs, without the traffic.
- `poll 5 s`: a node older than Watch (`--no-watch`), asked with Describe
  every `node_refresh_s` = 5 s (the default).
- `poll 0.1 s`: the same, asked every 0.1 s: about as fresh as the watch's
  push on a change, which is what routing by a node's load needs.

CPU time is read from the kernel's per-thread scheduler statistics
(nanoseconds, `/proc/PID/task/*/schedstat`), not psutil's 10 ms ticks: ten
idle nodes cost a few milliseconds of CPU in a window. The node's CPU is
shown beside the edge's (what the fleet pays to be asked).
Rounds alternate the modes, so drift hits all alike; with several rounds
(one by default) the figure is their median, with their range.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import fmt, sig, table
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

STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Mode:
    label: str
    watch: bool
    refresh_s: float
    heartbeat_s: float = 2.0


MODES = (
    Mode("watch", True, 5.0),
    Mode("watch, all busy", True, 5.0, heartbeat_s=0.1),
    Mode("poll 5 s", False, 5.0),
    Mode("poll 0.1 s", False, 0.1),
)


@dataclass(frozen=True)
class ControlPlaneSettings:
    sizes: tuple[int, ...] = (10, 100, 300)
    rounds: int = 1
    # Two refresh intervals of the default polling: a window of one would hold one
    # round of Describe calls or two, by where it starts.
    seconds: float = 10.0
    settle_s: float = 2.0


QUICK = ControlPlaneSettings(sizes=(10, 100), seconds=5.0, settle_s=1.0)

EDGE_CONFIG = """\
[server]
listen = "127.0.0.1:{port}"
drain_timeout_s = 2
node_refresh_s = {refresh_s}

[routing]
watch_heartbeat_s = {heartbeat_s}

[log]
level = "WARNING"
"""


def _measure_one(tmp: Path, n: int, mode: Mode, s: ControlPlaneSettings) -> dict[str, Any]:
    where = tmp / f"{mode.label.replace(' ', '-')}-{n}"
    where.mkdir(parents=True, exist_ok=True)
    sim_log = where / "sim.log"
    flags = ["--nodes", str(n), "--listen", "127.0.0.1:0", "--name", "cp"]
    if not mode.watch:
        flags.append("--no-watch")
    sim = spawn([venv_script("iop-sim-node"), *flags], sim_log)
    edge = None
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        addresses: list[str] = []
        while time.monotonic() < deadline:
            text = sim_log.read_text(errors="replace")
            lines = [x for x in text.splitlines() if "listening on" in x]
            if len(lines) >= n:
                addresses = [x.rsplit(" ", 1)[-1] for x in lines[:n]]
                break
            if sim.poll() is not None:
                raise SystemExit(f"iop-sim-node exited: {sim_log.read_text()[-500:]}")
            time.sleep(0.05)
        else:
            raise SystemExit("iop-sim-node did not start in time")
        port = free_port()
        config = EDGE_CONFIG.format(
            port=port, refresh_s=mode.refresh_s, heartbeat_s=mode.heartbeat_s
        ) + "".join(
            f'\n[[nodes]]\nname = "cp-{i + 1}"\naddress = "{a}"\n' for i, a in enumerate(addresses)
        )
        (where / "config.toml").write_text(config)
        edge = spawn(
            [venv_script("iop-edge"), "--config", str(where / "config.toml")], where / "edge.log"
        )
        base = f"http://127.0.0.1:{port}"
        while time.monotonic() < deadline:
            if edge.poll() is not None:
                raise SystemExit(f"iop-edge exited: {(where / 'edge.log').read_text()[-800:]}")
            if get_status(base + "/readyz") == 200 and up_nodes(base) >= n:
                break
            time.sleep(0.1)
        else:
            raise SystemExit(f"the edge did not see its {n} nodes up in time")
        time.sleep(s.settle_s)
        e0, n0, t0 = cpu_s(edge.pid), cpu_s(sim.pid), time.monotonic()
        time.sleep(s.seconds)
        e1, n1, t1 = cpu_s(edge.pid), cpu_s(sim.pid), time.monotonic()
        up = up_nodes(base)
        wall = t1 - t0
        return {
            "mode": mode.label, "nodes": n, "wall_s": sig(wall), "up_after": up,
            "edge_us_per_node_s": sig((e1 - e0) * 1e6 / (n * wall)),
            "node_us_per_node_s": sig((n1 - n0) * 1e6 / (n * wall)),
            "edge_core_pct": sig((e1 - e0) * 100 / wall),
            "edge_rss_mb": sig(Probe(edge.pid).rss() / 2**20),
        }  # fmt: skip
    finally:
        stop_process(edge)
        stop_process(sim)


def measure_control_plane(
    tmp: Path, s: ControlPlaneSettings, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every size and mode, the modes alternating within each round."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for rnd in range(s.rounds):
        for n in s.sizes:
            for mode in MODES:
                r = _measure_one(tmp / f"round-{rnd}", n, mode, s)
                runs.setdefault((n, mode.label), []).append(r)
                say(
                    f"control plane: {mode.label}, {n} nodes: {r['edge_us_per_node_s']} us edge "
                    f"CPU per node per s ({r['up_after']} up)"
                )
    out: dict[str, Any] = {"settings": s.__dict__, "rows": []}
    for (n, label), rs in runs.items():
        edge = [r["edge_us_per_node_s"] for r in rs]
        node = [r["node_us_per_node_s"] for r in rs]
        out["rows"].append({
            "nodes": n, "mode": label, "edge_us_per_node_s": edge, "node_us_per_node_s": node,
            "edge_core_pct": [r["edge_core_pct"] for r in rs],
            "edge_rss_mb": [r["edge_rss_mb"] for r in rs],
            "up_after": min(r["up_after"] for r in rs),
        })  # fmt: skip
    return out


def _med(values: list[float]) -> str:
    text = fmt(statistics.median(values))
    return text if len(values) < 2 else f"{text} ({fmt(min(values))}-{fmt(max(values))})"


def render_control_plane(r: dict[str, Any]) -> list[str]:
    s = r["settings"]
    rows = [
        [
            str(row["nodes"]), row["mode"], _med(row["edge_us_per_node_s"]),
            _med(row["edge_core_pct"]), _med(row["node_us_per_node_s"]),
            fmt(statistics.median(row["edge_rss_mb"])), f"{row['up_after']}/{row['nodes']}",
        ]
        for row in r["rows"]
    ]  # fmt: skip
    return [
        f"Control-plane cost, idle ({s['rounds']} rounds of {s['seconds']} s per size and mode, "
        "modes alternating; one iop-sim-node process serves every node)",
        table(
            [
                "nodes",
                "how the edge learns node state",
                "edge CPU, us per node per s",
                "edge, % of a core",
                "node CPU, us per node per s",
                "edge RSS MB",
                "up",
            ],
            rows,
        ),
    ]
