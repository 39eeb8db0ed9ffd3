"""Tracing cost: the same edge with tracing off and on (ratio 1.0), side by side, in one run.

Each round runs both configurations in turn, each on a stack of its own (one
`iop-sim-node`, the edge with or without `[tracing] enabled = true`,
`sample_ratio = 1.0`, exporting OTLP/HTTP to a sink in this process that
answers every export at once), with the same two workloads as
`benchmarks.workers`, driven by the load-generator processes:

- non-stream: a closed loop of keep-alive connections (one short delta per
  request); figure: the edge's CPU per request (one span each, exported).
- streams: concurrent streams of zero-delay deltas; figure: the edge's CPU
  per content chunk (one span per stream: nothing is added per chunk).

The edge's CPU includes its exporter thread (serializing and posting the
spans): the tracing edge exports every 100 ms (OTEL_BSP_SCHEDULE_DELAY), and
each phase's CPU is read once the edge is idle again after it, so a phase
pays for the export of its own spans, not the next one's. Added cost =
(on - off) / off, per request and per chunk; the issue's goal is < 5% per
chunk at ratio 1.0.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.httpclient import build_post
from benchmarks.loadgen import Pool
from benchmarks.report import added_pct, fmt, median_span, sig, table
from benchmarks.scripts import SHORT_SCRIPT, chat_body, long_script
from benchmarks.stack import EdgeSource, Probe, Stack
from benchmarks.workers import phase, settle, wait_workers


@dataclass(frozen=True)
class TracingSettings:
    rounds: int = 3
    conns: int = 16
    seconds: float = 4.0
    streams: int = 25
    chunks: int = 1000
    timeout_s: float = 60.0


QUICK = TracingSettings(rounds=2, seconds=2.0, streams=10, chunks=500)
EXPORT_DELAY_MS = 100


def _cpu(probes: list[Probe]) -> float:
    return sum(p.cpu() for p in probes)


def _exported(probes: list[Probe]) -> None:
    """Until the spans of the phase just run are exported (the next schedule) and the
    edge is idle."""
    time.sleep(3 * EXPORT_DELAY_MS / 1000)
    settle(probes)


@dataclass
class Sink:
    """An OTLP/HTTP endpoint that takes every export and answers 200 at once."""

    url: str = ""
    exports: int = 0
    bytes: int = 0


@contextmanager
def otlp_sink() -> Iterator[Sink]:
    sink = Sink()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: one connection per exporter

        def do_POST(self) -> None:  # the stdlib's naming
            size = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(size)
            with lock:
                sink.exports += 1
                sink.bytes += size
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    sink.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield sink
    finally:
        server.shutdown()
        server.server_close()


def _measure_one(
    pool: Pool, tmp: Path, on: bool, sink: Sink, s: TracingSettings, log: Callable[[str], None]
) -> dict[str, Any]:
    label = "tracing on" if on else "tracing off"
    where = tmp / label.replace(" ", "-")
    where.mkdir(parents=True, exist_ok=True)
    extra = (
        f'\n[tracing]\nenabled = true\nendpoint = "{sink.url}"\nsample_ratio = 1.0\n' if on else ""
    )
    source = EdgeSource(label=label, env=(("OTEL_BSP_SCHEDULE_DELAY", str(EXPORT_DELAY_MS)),))
    with Stack(where, source, extra_config=extra) as stack:
        probes = wait_workers(stack, 1)
        assert stack.node_probe is not None
        host, port = "127.0.0.1", stack.edge_port
        short = build_post(
            host, port, "/v1/chat/completions", chat_body(SHORT_SCRIPT, stream=False)
        )
        streamed = build_post(
            host, port, "/v1/chat/completions", chat_body(long_script(s.chunks), stream=True)
        )
        phase(
            pool, probes, stack.node_probe, "closed", host=host, port=port, request=short,
            conns=4, seconds=0.5, timeout_s=s.timeout_s,
        )  # fmt: skip
        _exported(probes)
        exports = sink.exports
        c0 = _cpu(probes)
        nonstream = phase(
            pool, probes, stack.node_probe, "closed", host=host, port=port, request=short,
            conns=s.conns, seconds=s.seconds, timeout_s=s.timeout_s,
        )  # fmt: skip
        _exported(probes)
        c1 = _cpu(probes)
        done = sum(p["requests"] for p in nonstream.pop("parts"))
        nonstream["requests"] = done
        nonstream["req_per_s"] = sig(done / nonstream["wall_s"])
        nonstream["edge_cpu_us_per_req"] = sig((c1 - c0) * 1e6 / max(done, 1))
        streams = phase(
            pool, probes, stack.node_probe, "streams", host=host, port=port, request=streamed,
            count=s.streams, connect_limit=128, timeout_s=s.timeout_s,
        )  # fmt: skip
        _exported(probes)
        c2 = _cpu(probes)
        chunks = sum(p["chunks"] for p in streams.pop("parts"))
        streams["chunks"] = chunks
        streams["chunks_per_s"] = sig(chunks / streams["wall_s"])
        streams["edge_cpu_us_per_chunk"] = sig((c2 - c1) * 1e6 / max(chunks, 1))
        log(
            f"tracing: {label}: {nonstream['edge_cpu_us_per_req']} us/request, "
            f"{streams['edge_cpu_us_per_chunk']} us/chunk"
        )
        return {
            "label": label, "on": on, "nonstream": nonstream, "streams": streams,
            "exports": sink.exports - exports,
        }  # fmt: skip


def measure_tracing(
    pool: Pool, tmp: Path, s: TracingSettings, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Tracing off and on, alternating, `s.rounds` times (drift hits both alike)."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    results: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    with otlp_sink() as sink:
        for rnd in range(s.rounds):
            for on in (False, True):
                results[on].append(_measure_one(pool, tmp / f"round-{rnd}", on, sink, s, say))
        sent = {"exports": sink.exports, "bytes": sink.bytes}
    out: dict[str, Any] = {"settings": s.__dict__, "clients": pool.size, "sink": sent}
    for on, runs in results.items():
        key = "on" if on else "off"
        out[key] = {
            "req_us": [r["nonstream"]["edge_cpu_us_per_req"] for r in runs],
            "chunk_us": [r["streams"]["edge_cpu_us_per_chunk"] for r in runs],
            "req_per_s": [r["nonstream"]["req_per_s"] for r in runs],
            "chunks_per_s": [r["streams"]["chunks_per_s"] for r in runs],
            "limits": [(r["nonstream"]["limit"], r["streams"]["limit"]) for r in runs],
        }
    for figure in ("req_us", "chunk_us"):
        out[f"added_{figure}_pct"] = added_pct(out["off"][figure], out["on"][figure])
    return out


def render_tracing(r: dict[str, Any]) -> list[str]:
    rows = []
    for key in ("off", "on"):
        d = r[key]
        rows.append([
            f"tracing {key}" + (" (ratio 1.0)" if key == "on" else ""),
            median_span(d["req_us"]),
            f"{fmt(statistics.median(d['req_per_s']))}",
            median_span(d["chunk_us"]),
            f"{fmt(statistics.median(d['chunks_per_s']))}",
        ])  # fmt: skip
    s = r["settings"]
    return [
        f"Tracing cost ({s['rounds']} rounds, off and on alternating; non-stream: closed loop, "
        f"{s['conns']} connections x {r['clients']} clients; streams: {s['streams']} x "
        f"{r['clients']} streams of {s['chunks']} deltas)",
        table(
            [
                "edge",
                "CPU per request, median (range)",
                "req/s",
                "CPU per chunk, median (range)",
                "chunks/s",
            ],
            rows,
        ),
        f"added by tracing at ratio 1.0: {fmt(r['added_req_us_pct'])}% CPU per request, "
        f"{fmt(r['added_chunk_us_pct'])}% CPU per chunk (goal < 5% per chunk); "
        f"{r['sink']['exports']} exports, {r['sink']['bytes']:,} bytes received",
        "(off and on run one after the other: a few percent is within this machine's drift;"
        " `python -m benchmarks.pair --tracing` runs both at once)",
    ]
