"""One run's harness (`Bench`): the stack, the load generator, the clock, and the workloads
measured in every round, through the edge and directly against the node.

`Bench` starts nothing: the caller hands it a started stack and pool (`benchmarks.workloads`
for `make bench`, `benchmarks.ab`, `benchmarks.pair`, `benchmarks.profile_edge`). Its
methods read the edge's and the node's CPU with psutil around each job and fold the
clients' reports into figures; every wait is bounded by a timeout. Which workloads run,
in which order and within which budget is the callers' business; the workloads measured
once per run are in `benchmarks.once`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.httpclient import build_post
from benchmarks.loadgen import Pool
from benchmarks.report import pct
from benchmarks.scripts import SHORT_SCRIPT, chat_body, long_script
from benchmarks.stack import Probe, Stack

mono = time.monotonic
START_DELAY_S = 0.3
SETTLE_TIMEOUT_S = 20.0


@dataclass
class Settings:
    """Sizes and bounds of one run (the command line fills it)."""

    rounds: int = 3
    clients: int = 2
    ttft_samples: int = 300
    long_chunks: int = 20_000
    concurrency: list[tuple[int, int]] = field(default_factory=lambda: [(100, 200), (1000, 20)])
    open_streams: list[int] = field(default_factory=lambda: [1000, 10_000])
    rates: list[float] = field(default_factory=lambda: [100.0, 1000.0])
    rate_seconds: float = 4.0
    # Paced streams: (count, tokens/s each, seconds). 1,000 x 50 tokens/s is 50,000
    # events/s: many cores of edge CPU at today's cost per chunk. The defaults keep each
    # half of it on two shared cores: 1,000 live streams (at 1 token/s; 14 s, since
    # opening 1,000 streams takes the edge seconds), and the real cadence of 50 tokens/s
    # (on 50 streams). paced_seconds is the length of a shape given without one.
    paced: list[tuple[int, float, float]] = field(
        default_factory=lambda: [(1000, 1.0, 14.0), (50, 50.0, 8.0)]
    )
    paced_seconds: float = 8.0
    disconnect_samples: int = 40
    budget_s: float = 420.0
    connect_limit: int = 128


@dataclass
class Bench:
    """One run: the stack, the clients, the settings, and the clock."""

    stack: Stack
    pool: Pool
    settings: Settings
    started: float = field(default_factory=mono)
    log_lines: list[str] = field(default_factory=list)

    # --- helpers -------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def port(self) -> int:
        return self.stack.edge_port

    @property
    def edge(self) -> Probe:
        assert self.stack.edge_probe is not None
        return self.stack.edge_probe

    @property
    def node(self) -> Probe:
        assert self.stack.node_probe is not None
        return self.stack.node_probe

    def log(self, text: str) -> None:
        line = f"[{mono() - self.started:6.1f}s] {text}"
        self.log_lines.append(line)
        print(line, file=sys.stderr, flush=True)

    def left(self) -> float:
        return self.settings.budget_s - (mono() - self.started)

    def post(self, text: str, *, stream: bool) -> bytes:
        return build_post(
            self.host, self.port, "/v1/chat/completions", chat_body(text, stream=stream)
        )

    def settle(self, limit_s: float = SETTLE_TIMEOUT_S) -> float:
        """Wait until the edge and the node are idle (< 3% of a core over 0.2 s); bounded."""
        t0 = mono()
        last = self.edge.cpu() + self.node.cpu()
        while mono() - t0 < limit_s:
            time.sleep(0.2)
            now = self.edge.cpu() + self.node.cpu()
            if now - last < 0.006:
                break
            last = now
        return mono() - t0

    def cpus(self) -> tuple[float, float]:
        return self.edge.cpu(), self.node.cpu()

    # --- streams ---------------------------------------------------------------------------

    def streams(self, via: str, count: int, chunks: int, timeout_s: float) -> dict[str, Any]:
        """`count` concurrent streams of `chunks` zero-delay deltas, via "edge" or "direct"."""
        text = long_script(chunks)
        start_at = mono() + START_DELAY_S + (0.5 if count > 200 else 0.0)
        if via == "edge":
            workers = min(self.pool.size, max(1, count // 100)) if count > 1 else 1
            self.pool.spread(
                workers,
                "streams",
                count,
                host=self.host,
                port=self.port,
                request=self.post(text, stream=True),
                connect_limit=self.settings.connect_limit,
                start_at=start_at,
                timeout_s=timeout_s,
            )
        else:
            workers = 1
            self.pool.submit(
                0,
                "direct_streams",
                node_port=self.stack.node_port,
                script=text,
                count=count,
                start_at=start_at,
                timeout_s=timeout_s,
            )
        time.sleep(max(0.0, start_at - mono()))
        e0, n0 = self.cpus()
        s0 = self.edge.cpu_sys()
        parts = [self.pool.result(i, timeout_s + 30) for i in range(workers)]
        e1, n1 = self.cpus()
        s1 = self.edge.cpu_sys()
        wall = max(p["t_end"] for p in parts) - min(p["t_start"] for p in parts)
        total = sum(p["chunks"] for p in parts)
        per = max(total, 1)
        out: dict[str, Any] = {
            "chunks": total,
            "wall_s": wall,
            "chunks_per_s": total / wall if wall > 0 else None,
            "edge_cpu_us_per_chunk": (e1 - e0) * 1e6 / per if via == "edge" else None,
            "node_cpu_us_per_chunk": (n1 - n0) * 1e6 / per,
            "client_cpu_us_per_chunk": sum(p["cpu_s"] for p in parts) * 1e6 / per,
            "edge_cores_busy": (e1 - e0) / wall if via == "edge" and wall > 0 else None,
            "node_cores_busy": (n1 - n0) / wall if wall > 0 else None,
            "streams_ok": sum(p["ok"] for p in parts),
            "incomplete": sum(p["incomplete"] for p in parts),
            "errors": sum(p["errors"] for p in parts),
            "unfinished": sum(p["unfinished"] for p in parts),
            "ttft_p50_ms": parts[0]["ttft_p50_ms"],
        }
        if via == "edge":
            out["edge_cpu_ms_per_stream"] = (e1 - e0) * 1e3 / count
            out["edge_cpu_kernel_share"] = (s1 - s0) / (e1 - e0) if e1 > e0 else None
            writes = sum(p["http_chunks"] for p in parts)
            out["frames_per_write"] = total / writes if writes else None
        first = next((p["first_error"] for p in parts if p["first_error"]), None)
        if first:
            out["first_error"] = first
        if out["chunks"] < count * chunks:
            self.log(f"  {via} {count}x{chunks}: {total} of {count * chunks} chunks; {first}")
        return out

    # --- time to first token -----------------------------------------------------------------

    def ttft(self, samples: int) -> dict[str, Any]:
        result = self.pool.run(
            "ttft",
            wait_s=120.0,
            host=self.host,
            port=self.port,
            node_port=self.stack.node_port,
            edge_request=self.post(SHORT_SCRIPT, stream=True),
            script=SHORT_SCRIPT,
            samples=samples,
            warmup=max(5, samples // 20),
            timeout_s=90.0,
        )
        edge, direct = result["edge_ms"], result["direct_ms"]
        paired = [e - d for e, d in zip(edge, direct, strict=True)]
        out = {
            "samples": len(edge),
            "edge_p50_ms": pct(edge, 50),
            "edge_p99_ms": pct(edge, 99),
            "direct_p50_ms": pct(direct, 50),
            "direct_p99_ms": pct(direct, 99),
            "paired_added_p50_ms": pct(paired, 50),
            "paired_added_p99_ms": pct(paired, 99),
        }
        if edge and direct:
            out["added_p50_ms"] = out["edge_p50_ms"] - out["direct_p50_ms"]  # type: ignore[operator]
            out["added_p99_ms"] = out["edge_p99_ms"] - out["direct_p99_ms"]  # type: ignore[operator]
            out["ratio_p50"] = out["edge_p50_ms"] / out["direct_p50_ms"]  # type: ignore[operator]
        return out

    # --- non-streaming requests at a fixed rate ------------------------------------------------

    def rate(self, via: str, rps: float, seconds: float) -> dict[str, Any]:
        start_at = mono() + START_DELAY_S
        common = {"rate": rps, "seconds": seconds, "start_at": start_at, "timeout_s": 10.0}
        if via == "edge":
            self.pool.submit(
                0,
                "rate",
                host=self.host,
                port=self.port,
                request=self.post(SHORT_SCRIPT, stream=False),
                max_conns=512,
                **common,
            )
        else:
            self.pool.submit(
                0, "direct_rate", node_port=self.stack.node_port, script=SHORT_SCRIPT, **common
            )
        time.sleep(max(0.0, start_at - mono()))
        e0, n0 = self.cpus()
        part = self.pool.result(0, seconds + 60.0)
        e1, n1 = self.cpus()
        lat = part["latencies_ms"]
        took = part["t_end"] - part["t_start"]
        span = took if part["stopped_at_s"] is not None else max(seconds, took)
        ok = len(lat)
        achieved = ok / span
        out: dict[str, Any] = {
            "rate": rps,
            "p50_ms": pct(lat, 50),
            "p90_ms": pct(lat, 90),
            "p99_ms": pct(lat, 99),
            "ok": ok,
            "errors": part["errors"],
            "unfinished": part["unfinished"],
            "achieved_rps": achieved,
            "saturated": achieved < 0.95 * rps
            or part["stopped_at_s"] is not None
            or part["errors"] + part["unfinished"] > 0.01 * ok,
            "stopped_at_s": part["stopped_at_s"],
            "node_cpu_us_per_req": (n1 - n0) * 1e6 / max(ok, 1),
            "client_cpu_us_per_req": part["cpu_s"] * 1e6 / max(ok, 1),
        }
        if via == "edge":
            out["edge_cpu_us_per_req"] = (e1 - e0) * 1e6 / max(ok, 1)
            out["edge_cores_busy"] = (e1 - e0) / span
            out["connections"] = part["connections"]
        if part["first_error"]:
            out["first_error"] = part["first_error"]
        return out

    # --- warm-up -------------------------------------------------------------------------------

    def warm_up(self) -> None:
        self.streams("edge", 4, 200, 30.0)
        self.streams("direct", 4, 200, 30.0)
        self.rate("edge", 50.0, 0.5)
        self.rate("direct", 50.0, 0.5)
        self.settle()
