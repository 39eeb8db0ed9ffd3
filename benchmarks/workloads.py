"""The orchestrator: each workload, measured through the edge and against its baseline.

Runs in the parent process, which does no load itself: it starts the stack and the
load-generator pool, hands jobs to the clients, reads the edge's and the node's CPU
and RSS with psutil around each job, and folds the clients' reports into figures.
Every wait is bounded by a timeout; the whole run by a time budget (optional parts
are skipped, and say so, once the budget is spent).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import paced
from benchmarks.httpclient import build_post
from benchmarks.loadgen import Pool
from benchmarks.report import pct, sig
from benchmarks.stack import Probe, Stack, node_active_runs, stop_process

mono = time.monotonic
START_DELAY_S = 0.3
SETTLE_TIMEOUT_S = 20.0


def script(*events: dict[str, Any]) -> str:
    return json.dumps({"events": list(events)}, separators=(",", ":"))


def long_script(n: int) -> str:
    return script(
        {"type": "delta", "delta": "tok", "repeat": n},
        {"type": "complete", "usage": {"output_tokens": n}, "metadata": {"finish_reason": "stop"}},
    )


SHORT_SCRIPT = script(
    {"type": "delta", "delta": "hello"},
    {"type": "complete", "usage": {"output_tokens": 1}, "metadata": {"finish_reason": "stop"}},
)
HANG_SCRIPT = script({"type": "delta", "delta": "hello"}, {"type": "hang"})


def chat_body(text: str, *, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": "sim-script",
        "messages": [{"role": "user", "content": text}],
    }
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


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

    def _cpu(self) -> tuple[float, float]:
        return self.edge.cpu(), self.node.cpu()

    # --- streams ---------------------------------------------------------------------------

    def streams(self, via: str, count: int, chunks: int, timeout_s: float) -> dict[str, Any]:
        """`count` concurrent streams of `chunks` zero-delay deltas, via "edge" or "direct"."""
        text = long_script(chunks)
        start_at = mono() + START_DELAY_S + (0.5 if count > 200 else 0.0)
        if via == "edge":
            workers = min(self.pool.size, max(1, count // 100)) if count > 1 else 1
            shares = [count // workers + (1 if i < count % workers else 0) for i in range(workers)]
            request = self.post(text, stream=True)
            for i, share in enumerate(shares):
                self.pool.submit(
                    i,
                    "streams",
                    host=self.host,
                    port=self.port,
                    request=request,
                    count=share,
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
        e0, n0 = self._cpu()
        s0 = self.edge.cpu_sys()
        parts = [self.pool.result(i, timeout_s + 30) for i in range(workers)]
        e1, n1 = self._cpu()
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

    def client_alone(self, chunks: int, conc: tuple[int, int] | None) -> dict[str, Any]:
        """The load generator against a trivially fast server (benchmarks.replay)."""
        out: dict[str, Any] = {}
        cases = [("one_stream", (1, chunks))] + ([("concurrency", conc)] if conc else [])
        for label, (count, n) in cases:
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.replay", str(n)],
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            try:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                if "listening on" not in line:
                    raise RuntimeError(f"replay server did not start: {line!r}")
                port = int(line.rsplit(":", 1)[1])
                request = build_post(self.host, port, "/v1/chat/completions", b"{}")
                start_at = mono() + START_DELAY_S
                workers = min(self.pool.size, max(1, count // 100))
                shares = [
                    count // workers + (1 if i < count % workers else 0) for i in range(workers)
                ]
                for i, share in enumerate(shares):
                    self.pool.submit(
                        i,
                        "streams",
                        host=self.host,
                        port=port,
                        request=request,
                        count=share,
                        connect_limit=self.settings.connect_limit,
                        start_at=start_at,
                        timeout_s=60.0,
                    )
                parts = [self.pool.result(i, 90.0) for i in range(workers)]
            finally:
                stop_process(proc)  # type: ignore[arg-type]
            wall = max(p["t_end"] for p in parts) - min(p["t_start"] for p in parts)
            total = sum(p["chunks"] for p in parts)
            out[f"{label}_{count}x{n}"] = {
                "chunks_per_s": total / wall if wall > 0 else None,
                "client_cpu_us_per_chunk": sum(p["cpu_s"] for p in parts) * 1e6 / max(total, 1),
                "chunks": total,
            }
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
        e0, n0 = self._cpu()
        part = self.pool.result(0, seconds + 60.0)
        e1, n1 = self._cpu()
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

    # --- disconnects -----------------------------------------------------------------------------

    def _cancel_latencies(
        self, closed: list[tuple[str, float]] | dict[str, float], wait_s: float
    ) -> dict[str, Any]:
        pairs = list(closed.items()) if isinstance(closed, dict) else list(closed)
        ids = {run_id for run_id, _ in pairs}
        got = self.stack.runs_log.wait_for(ids, wait_s)
        latencies: list[float] = []
        with_rpc = 0
        for run_id, t_close in pairs:
            entry = self.stack.runs_log.get(run_id)
            if entry is None:
                continue
            at, record = entry
            if record.get("cancel_rpc"):
                with_rpc += 1
                latencies.append((at - t_close) * 1e3)
        return {
            "runs": len(pairs),
            "ended_on_node": got,
            "with_cancel_rpc": with_rpc,
            "p50_ms": pct(latencies, 50),
            "p99_ms": pct(latencies, 99),
            "max_ms": max(latencies) if latencies else None,
        }

    def disconnects(self, samples: int) -> dict[str, Any]:
        result = self.pool.run(
            "disconnects",
            wait_s=120.0,
            host=self.host,
            port=self.port,
            node_port=self.stack.node_port,
            edge_request=self.post(HANG_SCRIPT, stream=True),
            script=HANG_SCRIPT,
            samples=samples,
            pause_s=0.02,
            timeout_s=60.0,
        )
        edge = self._cancel_latencies([(r, t) for r, t in result["edge"]], 10.0)
        direct = self._cancel_latencies([(r, t) for r, t in result["direct"]], 10.0)
        out = {
            "samples": edge["runs"],
            "edge_p50_ms": edge["p50_ms"],
            "edge_p99_ms": edge["p99_ms"],
            "edge_with_cancel_rpc": edge["with_cancel_rpc"],
            "direct_p50_ms": direct["p50_ms"],
            "direct_p99_ms": direct["p99_ms"],
            "direct_with_cancel_rpc": direct["with_cancel_rpc"],
        }
        if edge["p50_ms"] is not None and direct["p50_ms"] is not None:
            out["added_p50_ms"] = edge["p50_ms"] - direct["p50_ms"]
        return out

    # --- open streams --------------------------------------------------------------------------

    def open_streams(self, count: int) -> dict[str, Any]:
        """Hold `count` streams open (the node hangs after one delta): RSS; then close all."""
        self.settle()
        active0 = node_active_runs(self.stack.node_port) or 0
        rss0 = self.edge.rss()
        node_rss0 = self.node.rss()
        e0, n0 = self._cpu()
        workers = self.pool.size if count >= 200 else 1
        shares = [count // workers + (1 if i < count % workers else 0) for i in range(workers)]
        request = self.post(HANG_SCRIPT, stream=True)
        open_timeout = max(30.0, min(150.0, self.left() - 30.0))
        t0 = mono()
        for i, share in enumerate(shares):
            self.pool.submit(
                i,
                "open_streams",
                host=self.host,
                port=self.port,
                request=request,
                count=share,
                connect_limit=self.settings.connect_limit,
                timeout_s=open_timeout,
            )
        reports = [self.pool.result(i, open_timeout + 30.0) for i in range(workers)]
        open_s = mono() - t0
        e1, n1 = self._cpu()
        time.sleep(1.0)
        rss1 = self.edge.rss()
        node_rss1 = self.node.rss()
        opened = sum(r["opened"] for r in reports)
        late0 = self.stack.runs_log.unknown_cancels
        gave_up0 = self.stack.edge_log().count("CancelRun for run")
        e2 = self.edge.cpu()
        for i in range(workers):
            self.pool.send(i, "close")
        # The node's own count of live runs says when every run has ended there (by the
        # stream reset or by CancelRun, whichever came first); bounded.
        ended_at: float | None = None
        limit = mono() + max(15.0, min(60.0, self.left()))
        while mono() < limit:
            active = node_active_runs(self.stack.node_port)
            if active is not None and active <= active0:
                ended_at = mono()
                break
            time.sleep(0.05)
        closed: dict[str, float] = {}
        for i in range(workers):
            closed.update(self.pool.result(i, 60.0)["closed"])
        e3 = self.edge.cpu()
        # Runs-log lines: at once on CancelRun, else 1 s after the reset (the node's grace).
        cancel = self._cancel_latencies(closed, wait_s=2.5)
        first_close = min(closed.values(), default=None)
        self.settle(10.0)
        rss2 = self.edge.rss()
        out = {
            "streams": count,
            "opened": opened,
            "open_errors": sum(r["errors"] + r["unfinished"] for r in reports),
            "open_s": open_s,
            "opens_per_s": opened / open_s if open_s > 0 else None,
            "edge_cpu_ms_per_open": (e1 - e0) * 1e3 / max(opened, 1),
            "node_cpu_ms_per_open": (n1 - n0) * 1e3 / max(opened, 1),
            "client_cpu_ms_per_open": sum(r["cpu_s"] for r in reports) * 1e3 / max(opened, 1),
            "rss_before_mib": rss0 / 2**20,
            "rss_with_streams_mib": rss1 / 2**20,
            "rss_after_close_mib": rss2 / 2**20,
            "rss_kib_per_stream": (rss1 - rss0) / 1024 / max(opened, 1),
            "node_rss_kib_per_stream": (node_rss1 - node_rss0) / 1024 / max(opened, 1),
            "all_ended_on_node_s": None
            if ended_at is None or first_close is None
            else ended_at - first_close,
            "cancel_rpc_in_grace": cancel["with_cancel_rpc"],
            "cancel_rpc_late": self.stack.runs_log.unknown_cancels - late0,
            "cancel_rpc_gave_up": self.stack.edge_log().count("CancelRun for run") - gave_up0,
            "cancel_p50_ms": cancel["p50_ms"],
            "cancel_p99_ms": cancel["p99_ms"],
            "edge_cpu_ms_per_close": (e3 - e2) * 1e3 / max(opened, 1),
            "bad_statuses": {
                str(k): v for r in reports for k, v in (r.get("bad_statuses") or {}).items()
            },
        }
        first = next((r["first_error"] for r in reports if r["first_error"]), None)
        if first:
            out["first_error"] = first
        return out

    # --- warm-up -------------------------------------------------------------------------------

    def warm_up(self) -> None:
        self.streams("edge", 4, 200, 30.0)
        self.streams("direct", 4, 200, 30.0)
        self.rate("edge", 50.0, 0.5)
        self.rate("direct", 50.0, 0.5)
        self.settle()


def measure_round(bench: Bench, rnd: int) -> dict[str, Any]:
    """One round of the repeated workloads; the edge and the direct path swap order."""
    from benchmarks.calibrate import calibrate

    s = bench.settings
    order = ("edge", "direct") if rnd % 2 == 0 else ("direct", "edge")
    # The yardstick is taken before every workload and the round uses the median: one
    # sample catches one moment of a shared machine (a busy SMT sibling halves it).
    samples = [calibrate()]
    r: dict[str, Any] = {}
    bench.log(f"round {rnd + 1}/{s.rounds}: ttft x{s.ttft_samples}")
    r["ttft"] = bench.ttft(s.ttft_samples)
    samples.append(calibrate())
    bench.log(f"round {rnd + 1}/{s.rounds}: 1 x {s.long_chunks}")
    r["one_stream"] = {}
    for via in order:
        r["one_stream"][via] = bench.streams(via, 1, s.long_chunks, 120.0)
        bench.settle()
    samples.append(calibrate())
    r["concurrency"] = {}
    for count, chunks in s.concurrency:
        bench.log(f"round {rnd + 1}/{s.rounds}: {count} x {chunks}")
        key = f"{count}x{chunks}"
        r["concurrency"][key] = {}
        for via in order:
            r["concurrency"][key][via] = bench.streams(via, count, chunks, 120.0)
            bench.settle()
        samples.append(calibrate())
    r["nonstream"] = {}
    for rps in s.rates:
        bench.log(f"round {rnd + 1}/{s.rounds}: non-stream {rps:g} req/s x {s.rate_seconds:g} s")
        key = f"{rps:g}rps"
        r["nonstream"][key] = {}
        for via in order:
            r["nonstream"][key][via] = bench.rate(via, rps, s.rate_seconds)
            bench.settle()
        samples.append(calibrate())
    r["paced"] = {}
    for count, tps, seconds in s.paced:
        bench.log(f"round {rnd + 1}/{s.rounds}: paced {count} x {tps:g} tokens/s x {seconds:g} s")
        key = f"{count}x{tps:g}"
        r["paced"][key] = {}
        for via in order:
            r["paced"][key][via] = paced.measure(bench, via, count, tps, seconds)
            bench.settle()
        samples.append(calibrate())
    r["calibration_us"] = statistics.median(samples)
    r["calibration_samples_us"] = [sig(x) for x in samples]
    return r


def run_workloads(bench: Bench) -> dict[str, Any]:
    """Every workload, in rounds; returns the raw per-round figures and the one-off ones."""
    s = bench.settings
    raw: dict[str, Any] = {"rounds": [], "once": {}}
    bench.log("warm-up")
    bench.warm_up()
    conc_big = max(s.concurrency, default=None)
    bench.log("load generator alone (replay server)")
    raw["once"]["client_alone"] = bench.client_alone(s.long_chunks, conc_big)
    for rnd in range(s.rounds):
        if rnd > 0 and bench.left() < 60:
            bench.log(f"round {rnd + 1}: skipped, the time budget is spent")
            break
        raw["rounds"].append(measure_round(bench, rnd))
    bench.log(f"disconnect -> CancelRun x{s.disconnect_samples}")
    raw["once"]["disconnect"] = bench.disconnects(s.disconnect_samples)
    raw["once"]["open_streams"] = {}
    for count in s.open_streams:
        if bench.left() < 20 + count / 250:
            bench.log(f"{count} open streams: skipped, the time budget is spent")
            raw["once"]["open_streams"][str(count)] = {"skipped": "time budget"}
            continue
        bench.log(f"{count} open streams")
        raw["once"]["open_streams"][str(count)] = bench.open_streams(count)
    return raw


def run(settings: Settings, tmp: Path) -> dict[str, Any]:
    """Start everything, measure, stop everything (whatever happens)."""
    with Stack(tmp) as stack:
        pool = Pool(settings.clients)
        try:
            bench = Bench(stack, pool, settings)
            bench.log(
                f"edge pid {bench.edge.pid} on :{stack.edge_port}, "
                f"node pid {bench.node.pid} on :{stack.node_port}, clients {pool.pids}"
            )
            raw = run_workloads(bench)
            raw["edge_rss_end_mib"] = bench.edge.rss() / 2**20
            raw["elapsed_s"] = mono() - bench.started
            return raw
        finally:
            pool.close()
