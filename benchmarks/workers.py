"""Throughput by worker count: the same edge with 1 and 2 worker processes, in one run.

Each configuration gets a stack of its own (one `iop-sim-node`, the edge with
`[server] workers = N`; for N > 1 each listen mode of `edge.process.supervisor`, set
by $IOP_EDGE_LISTEN_MODE) and the same two workloads, driven by the
load-generator processes (asyncio, raw HTTP/1.1):

- non-stream: a closed loop of keep-alive connections, each sending its next
  `sim-script` request (one short delta) as soon as the last was answered;
  figure: requests answered per second.
- streams: concurrent streams of zero-delay deltas; figure: content chunks
  received per second.

Nothing is pinned to a core: the edge's processes, the node and the load
generators share the machine's cores, as the kernel schedules them. So beside
each figure the run reports how busy each process was (cores: CPU seconds per
wall second) and names the limit: `client` when a load-generator process
was at >= 90% of a core (the figure is the client's, not the edge's),
`machine` when the processes together used >= 90% of every core (the edge
cannot get more CPU than it had), else `edge`. The balance of a run with
workers is the busiest worker's CPU over the idlest's.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]

from benchmarks.httpclient import build_post
from benchmarks.loadgen import Pool
from benchmarks.report import fmt, sig, table
from benchmarks.scripts import SHORT_SCRIPT, chat_body, long_script
from benchmarks.stack import EdgeSource, Probe, Stack

mono = time.monotonic
START_DELAY_S = 0.3
CLIENT_BOUND = 0.9
MACHINE_BOUND = 0.9
GOAL = 1.7


@dataclass(frozen=True)
class WorkerSettings:
    counts: tuple[int, ...] = (1, 2)
    # Each round runs every configuration once, in turn (so drift hits all alike).
    rounds: int = 2
    modes: tuple[str, ...] = ("shared", "reuseport")
    # Closed-loop connections per load-generator process, and seconds per run.
    conns: int = 32
    seconds: float = 6.0
    # Streams per load-generator process, and deltas per stream.
    streams: int = 50
    chunks: int = 1000
    timeout_s: float = 60.0


QUICK = WorkerSettings(rounds=1, seconds=3.0, streams=25, chunks=400)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (not idle, not waiting on I/O)."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)  # inside user already
    return float(sum(t) - idle - guest)


def settle(probes: list[Probe], limit_s: float = 20.0) -> None:
    """Until the edge's processes are idle (< 3% of a core over 0.2 s); bounded."""
    t0 = mono()
    last = sum(p.cpu() for p in probes)
    while mono() - t0 < limit_s:
        time.sleep(0.2)
        now = sum(p.cpu() for p in probes)
        if now - last < 0.006:
            return
        last = now


def wait_workers(stack: Stack, count: int, limit_s: float = 30.0) -> list[Probe]:
    """The edge's processes, once all its workers run and have gone idle."""
    deadline = mono() + limit_s
    while mono() < deadline:
        probes = stack.edge_processes()
        if count == 1 or len(probes) == count + 1:
            settle(probes)
            return probes
        time.sleep(0.1)
    raise SystemExit(f"the edge did not start {count} workers in time")


def phase(pool: Pool, probes: list[Probe], node: Probe, job: str, **kwargs: Any) -> dict[str, Any]:
    """One workload on every load-generator process at once, with the CPU of each process."""
    start_at = mono() + START_DELAY_S
    for i in range(pool.size):
        pool.submit(i, job, start_at=start_at, **kwargs)
    time.sleep(max(0.0, start_at - mono()))
    before = [p.cpu() for p in probes]
    n0, m0 = node.cpu(), _machine_busy()
    parts = [pool.result(i, kwargs["timeout_s"] + 60) for i in range(pool.size)]
    after = [p.cpu() for p in probes]
    n1, m1 = node.cpu(), _machine_busy()
    wall = max(p["t_end"] for p in parts) - min(p["t_start"] for p in parts)
    used = [a - b for a, b in zip(after, before, strict=True)]
    workers = used[1:] if len(used) > 1 else used
    clients = [p["cpu_s"] / wall for p in parts]
    edge = sum(used) / wall
    ours = edge + (n1 - n0) / wall + sum(clients)
    # Busy CPU of the whole machine (ours, the other work on it), over the wall time.
    busy = max(ours, (m1 - m0) / wall)
    limit = "edge"
    if max(clients) >= CLIENT_BOUND:
        limit = "client"
    elif busy >= MACHINE_BOUND * _cores():
        limit = "machine"
    return {
        "parts": parts,
        "wall_s": sig(wall),
        "edge_cores": sig(edge),
        "worker_cores": [sig(w / wall) for w in workers],
        "balance": sig(max(workers) / min(workers)) if min(workers) > 0 else None,
        "node_cores": sig((n1 - n0) / wall),
        "client_cores": [sig(c) for c in clients],
        "all_cores": sig(busy),
        "other_cores": sig(max(0.0, busy - ours)),
        "limit": limit,
        "errors": sum(p["errors"] for p in parts),
        "first_error": next((p["first_error"] for p in parts if p.get("first_error")), None),
    }


def _measure_one(
    pool: Pool, tmp: Path, count: int, mode: str, s: WorkerSettings, log: Callable[[str], None]
) -> dict[str, Any]:
    label = f"{count} worker{'s' if count > 1 else ''}" + (f", {mode}" if count > 1 else "")
    where = tmp / f"workers-{count}-{mode}"
    where.mkdir(parents=True, exist_ok=True)
    source = EdgeSource(label=label, env=(("IOP_EDGE_LISTEN_MODE", mode),))
    with Stack(where, source, server_keys=f"workers = {count}") as stack:
        probes = wait_workers(stack, count)
        assert stack.node_probe is not None
        host, port = "127.0.0.1", stack.edge_port
        short = build_post(
            host, port, "/v1/chat/completions", chat_body(SHORT_SCRIPT, stream=False)
        )
        streamed = build_post(
            host, port, "/v1/chat/completions", chat_body(long_script(s.chunks), stream=True)
        )
        log(f"workers: {label}: warming up")
        phase(
            pool, probes, stack.node_probe, "closed", host=host, port=port, request=short,
            conns=4, seconds=0.5, timeout_s=s.timeout_s,
        )  # fmt: skip
        settle(probes)
        nonstream = phase(
            pool, probes, stack.node_probe, "closed", host=host, port=port, request=short,
            conns=s.conns, seconds=s.seconds, timeout_s=s.timeout_s,
        )  # fmt: skip
        done = sum(p["requests"] for p in nonstream.pop("parts"))
        nonstream["requests"] = done
        nonstream["req_per_s"] = sig(done / nonstream["wall_s"])
        nonstream["per_edge_core"] = sig(done / nonstream["wall_s"] / nonstream["edge_cores"])
        log(f"workers: {label}: non-stream {nonstream['req_per_s']} req/s")
        settle(probes)
        streams = phase(
            pool, probes, stack.node_probe, "streams", host=host, port=port, request=streamed,
            count=s.streams, connect_limit=128, timeout_s=s.timeout_s,
        )  # fmt: skip
        parts = streams.pop("parts")
        chunks = sum(p["chunks"] for p in parts)
        streams["chunks"] = chunks
        streams["chunks_expected"] = s.streams * s.chunks * pool.size
        streams["chunks_per_s"] = sig(chunks / streams["wall_s"])
        streams["per_edge_core"] = sig(chunks / streams["wall_s"] / streams["edge_cores"])
        log(f"workers: {label}: streams {streams['chunks_per_s']} chunks/s")
        return {"label": label, "workers": count, "mode": mode, "nonstream": nonstream,
                "streams": streams}  # fmt: skip


def measure_workers(
    pool: Pool, tmp: Path, s: WorkerSettings, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every configuration (1 worker; each listen mode with more), one after the other."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    configs = [(c, m) for c in s.counts for m in (s.modes if c > 1 else s.modes[:1])]
    rounds: list[list[dict[str, Any]]] = [[] for _ in configs]
    for rnd in range(s.rounds):
        for i, (count, mode) in enumerate(configs):
            rounds[i].append(_measure_one(pool, tmp / f"round-{rnd}", count, mode, s, say))
    runs = []
    for results in rounds:
        run = dict(results[-1])
        for kind, key in (("nonstream", "req_per_s"), ("streams", "chunks_per_s")):
            values = [r[kind][key] for r in results]
            run[kind] = {**run[kind], key: sig(statistics.median(values)), "rounds": values}
        runs.append(run)
    say("workers: the cost of one Describe")
    describe = measure_describe(tmp)
    return {
        "settings": s.__dict__, "clients": pool.size, "cores": _cores(), "runs": runs,
        "describe": describe,
    }  # fmt: skip


def measure_describe(tmp: Path, calls: int = 2000) -> dict[str, Any]:
    """What one Describe (the health and model poll, every node_refresh_s per edge process
    per node) costs: CPU on the asking side (the edge's own asyncio node code, called
    here in this process) and on the node, and the bytes of its answer."""
    import asyncio

    from edge.node.grpc import GrpcNode, NodeSocket

    where = tmp / "describe"
    where.mkdir(parents=True, exist_ok=True)
    with Stack(where) as stack:
        assert stack.node_probe is not None
        node = stack.node_probe

        async def ask() -> tuple[float, float, int]:
            grpc = GrpcNode(NodeSocket.tcp("127.0.0.1", stack.node_port))
            try:
                answer = await grpc.describe()  # connects
                c0, n0 = time.process_time(), node.cpu()
                for _ in range(calls):
                    await grpc.describe()
                return time.process_time() - c0, node.cpu() - n0, len(bytes(answer))
            finally:
                await grpc.aclose()

        asker_s, node_s, size = asyncio.run(ask())
    return {
        "calls": calls,
        "asker_cpu_us": sig(asker_s * 1e6 / calls),
        "node_cpu_us": sig(node_s * 1e6 / calls),
        "answer_bytes": size,
    }


def render_describe(d: dict[str, Any]) -> str:
    return (
        f"Describe ({d['calls']} in a row, sim node with 2 models): asker CPU "
        f"{fmt(d['asker_cpu_us'])} us, node CPU {fmt(d['node_cpu_us'])} us, answer "
        f"{d['answer_bytes']} bytes (protobuf) per call"
    )


def render_workers(r: dict[str, Any]) -> list[str]:
    runs = r["runs"]
    base = runs[0]
    rows = []
    for run in runs:
        ns, st = run["nonstream"], run["streams"]
        ns_x = ns["req_per_s"] / base["nonstream"]["req_per_s"]
        st_x = st["chunks_per_s"] / base["streams"]["chunks_per_s"]
        rows.append([
            run["label"], f"{fmt(ns['req_per_s'])} {_span(ns['rounds'])} (x{fmt(ns_x)})",
            _where(ns), f"{fmt(st['chunks_per_s'])} {_span(st['rounds'])} (x{fmt(st_x)})",
            _where(st),
        ])  # fmt: skip
    best = {
        kind: max((run[kind][key] for run in runs if run["workers"] > 1), default=None)
        for kind, key in (("nonstream", "req_per_s"), ("streams", "chunks_per_s"))
    }
    lines = [
        f"Throughput by worker count ({r['cores']} cores shared by the edge, the node and "
        f"{r['clients']} load-generator processes, none pinned; other work on the machine "
        "shows in 'all')",
        table(
            [
                "edge",
                "non-stream req/s (vs 1)",
                "cores: edge [per worker] node client other all; limit",
                "stream chunks/s, median (range) (vs 1)",
                "cores: edge [per worker] node client other all; limit",
            ],
            rows,
        ),
    ]
    lines.append(
        "per edge core (figure / edge cores busy, last round): "
        + "; ".join(
            f"{run['label']}: {fmt(run['nonstream']['per_edge_core'])} req/s, "
            f"{fmt(run['streams']['per_edge_core'])} chunks/s"
            for run in runs
        )
    )
    for kind, key, unit in (
        ("nonstream", "req_per_s", "req/s"),
        ("streams", "chunks_per_s", "chunks/s"),
    ):
        if best[kind] is not None:
            factor = best[kind] / base[kind][key]
            lines.append(
                f"goal: 2 workers >= {GOAL}x of 1 in {unit}: x{fmt(factor)} "
                f"({'met' if factor >= GOAL else 'not met'})"
            )
    if "describe" in r:
        lines.append(render_describe(r["describe"]))
    return lines


def _span(values: list[float]) -> str:
    return f"({fmt(min(values))}..{fmt(max(values))})" if len(values) > 1 else ""


def _where(fig: dict[str, Any]) -> str:
    per = "/".join(fmt(w) for w in fig["worker_cores"])
    clients = "+".join(fmt(c) for c in fig["client_cores"])
    text = (
        f"{fmt(fig['edge_cores'])} [{per}] {fmt(fig['node_cores'])} {clients} "
        f"{fmt(fig['other_cores'])} {fmt(fig['all_cores'])}; {fig['limit']}"
    )
    if fig.get("errors"):
        text += f"; {fig['errors']} errors ({fig['first_error']})"
    return text
