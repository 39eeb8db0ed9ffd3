"""The paced workload: tokens as real nodes send them, one per event, at a fixed rate.

`count` streams of `rate` tokens/s for `seconds`: the simulated node plays a sim-script
of single-token deltas with `{"sleep_ms": 1000/rate}` between them, so every token is
one RunEvent (no batching at the source). Stream starts are spread evenly over a ramp
(a real edge never sees a thousand requests in the same millisecond), and the figures
are taken in the steady window, measured from the streams themselves: from the moment
the last stream got its first token to the moment the first stream got its last one.
Every stream is live in it, and no stream is opened or closed in it (opening one costs
the edge milliseconds of CPU, which would swamp the per-token figure):

- edge CPU per chunk: the edge's CPU over the window (psutil, sampled by the
  orchestrator every 0.1 s and interpolated at the window's edges) over the content
  frames the clients received in it;
- inter-chunk gap p50/p99: time between consecutive content frames of a stream, at the
  client, for gaps that end in the window; "added" is the edge's percentile minus the
  same percentile through the node client directly (`GrpcNodeClient`, in load-generator
  processes against the same node), measured in the same run.

Frames that arrive in one read share a time: a batched write shows as one long gap and
short ones, which the p99 sees. The jobs run in the load-generator processes
(`benchmarks.jobs.paced`); `measure`, here, is the orchestrator's side.
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from benchmarks.report import pct

if TYPE_CHECKING:
    from benchmarks.loadgen import Pool
    from benchmarks.stack import Probe, Stack

mono = time.monotonic
START_DELAY_S = 0.5
# Stream starts are spread over this much time per stream (opening a stream costs the
# edge a few ms of CPU: 1,000 at once would delay the first tokens by seconds), within
# bounds.
RAMP_PER_STREAM_S = 0.003
RAMP_BOUNDS_S = (0.5, 3.0)
# Below this share of the offered rate the run is saturated (the node's sleeps drift a
# little even when idle: ~21.5 ms for 20 ms, so 95% would flag an idle machine).
SATURATED_BELOW = 0.85
# CPU samples of the edge and the node while a paced run goes on.
SAMPLE_EVERY_S = 0.1


def paced_script(tokens: int, rate: float) -> str:
    """`tokens` single-token deltas, `1000/rate` ms apart, then complete."""
    events: list[dict[str, Any]] = []
    gap = {"sleep_ms": round(1000.0 / rate, 3)}
    for i in range(tokens):
        if i:
            events.append(gap)
        events.append({"type": "delta", "delta": " tik" if i % 2 else " tok"})
    events.append(
        {
            "type": "complete",
            "usage": {"output_tokens": tokens},
            "metadata": {"finish_reason": "stop"},
        }
    )
    return json.dumps({"events": events}, separators=(",", ":"))


def window_gaps(stamps: Sequence[float], w0: float, w1: float) -> tuple[array[float], int]:
    """Gaps between consecutive frames that end in [w0, w1], and the frames in it."""
    gaps: array[float] = array("d")
    frames = 0
    prev = None
    for t in stamps:
        if w0 <= t <= w1:
            frames += 1
            if prev is not None:
                gaps.append(t - prev)
        prev = t
    return gaps, frames


def window_figures(
    streams: Sequence[Sequence[float]], w0: float, w1: float
) -> tuple[list[float], int]:
    """Every stream's gaps that end in [w0, w1] (ms), and the frames in it."""
    gaps: array[float] = array("d")
    frames = 0
    for stamps in streams:
        g, n = window_gaps(stamps, w0, w1)
        gaps.extend(g)
        frames += n
    return [g * 1e3 for g in gaps], frames


def steady_window(streams: Sequence[Sequence[float]]) -> tuple[float, float] | None:
    """From the last stream's first frame to the first stream's last frame (or None).

    Streams that got no frame at all (failed) are left out; they are counted as errors.
    """
    live = [s for s in streams if s]
    if not live:
        return None
    w0 = max(s[0] for s in live)
    w1 = min(s[-1] for s in live)
    return (w0, w1) if w1 > w0 else None


def _streams_of(part: dict[str, Any]) -> list[array[float]]:
    flat: array[float] = array("d")
    flat.frombytes(part["stamps"])
    out = []
    at = 0
    for n in part["lengths"]:
        out.append(flat[at : at + n])
        at += n
    return out


def _interpolate(samples: list[tuple[float, float, float]], t: float) -> tuple[float, float]:
    """(edge CPU, node CPU) at time t, linear between the two samples around it."""
    before = max((x for x in samples if x[0] <= t), default=samples[0])
    after = min((x for x in samples if x[0] >= t), default=samples[-1])
    if after[0] == before[0]:
        return before[1], before[2]
    k = (t - before[0]) / (after[0] - before[0])
    return (
        before[1] + k * (after[1] - before[1]),
        before[2] + k * (after[2] - before[2]),
    )


class Harness(Protocol):
    """What `measure` uses of a run (`benchmarks.harness.Bench` is one)."""

    pool: Pool
    stack: Stack

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def edge(self) -> Probe: ...
    @property
    def node(self) -> Probe: ...
    def log(self, text: str) -> None: ...
    def post(self, text: str, *, stream: bool) -> bytes: ...


@dataclass(frozen=True)
class Plan:
    """One paced run: its script, and when and how fast its streams start."""

    tokens: int
    script: str
    ramp_s: float
    start_at: float
    timeout_s: float

    @classmethod
    def of(cls, count: int, rate: float, seconds: float) -> Plan:
        tokens = max(2, round(rate * seconds))
        lo, hi = RAMP_BOUNDS_S
        ramp = min(max(lo, count * RAMP_PER_STREAM_S), hi, seconds / 3)
        return cls(
            tokens, paced_script(tokens, rate), ramp, mono() + START_DELAY_S, seconds * 3 + 30.0
        )

    def job_args(self, total: int) -> dict[str, Any]:
        """What every load-generator job of the run gets (beside its share)."""
        return {"total": total, "start_at": self.start_at, "ramp_s": self.ramp_s,
                "timeout_s": self.timeout_s}  # fmt: skip


def measure(bench: Harness, via: str, count: int, rate: float, seconds: float) -> dict[str, Any]:
    """`count` streams of `rate` tokens/s for `seconds`, via "edge" or "direct"."""
    plan = Plan.of(count, rate, seconds)
    tokens, script, ramp, timeout_s = plan.tokens, plan.script, plan.ramp_s, plan.timeout_s
    workers = min(bench.pool.size, max(1, count // 100))
    shares = [count // workers + (1 if i < count % workers else 0) for i in range(workers)]
    common = plan.job_args(count)
    offset = 0
    for i, share in enumerate(shares):
        if via == "edge":
            request = bench.post(script, stream=True)
            bench.pool.submit(
                i, "paced_edge", host=bench.host, port=bench.port, request=request,
                count=share, offset=offset, **common,
            )  # fmt: skip
        else:
            bench.pool.submit(
                i, "paced_direct", node_port=bench.stack.node_port, script=script,
                count=share, offset=offset, **common,
            )  # fmt: skip
        offset += share
    # The edge's and the node's CPU, sampled until every worker has answered (bounded).
    samples: list[tuple[float, float, float]] = []
    limit = mono() + START_DELAY_S + timeout_s + 30
    waiting = list(range(workers))
    while waiting and mono() < limit:
        samples.append((mono(), bench.edge.cpu(), bench.node.cpu()))
        waiting = [i for i in waiting if not bench.pool.ready(i, SAMPLE_EVERY_S)]
    samples.append((mono(), bench.edge.cpu(), bench.node.cpu()))
    parts = [bench.pool.result(i, 1.0) for i in range(workers)]
    streams = [s for p in parts for s in _streams_of(p)]
    window = steady_window(streams)
    chunks = sum(p["chunks"] for p in parts)
    out: dict[str, Any] = {
        "streams": count,
        "rate": rate,
        "tokens_per_stream": tokens,
        "ramp_s": ramp,
        "offered_chunks_per_s": count * rate,
        "client_cpu_us_per_chunk": sum(p["cpu_s"] for p in parts) * 1e6 / max(chunks, 1),
        "chunks": chunks,
        "streams_ok": sum(p["ok"] for p in parts),
        "errors": sum(p["errors"] for p in parts),
        "unfinished": sum(p["unfinished"] for p in parts),
    }
    if window is None:
        out["saturated"] = True
        out["no_steady_window"] = "no moment had every stream live"
        bench.log(f"  paced {via} {count}x{rate:g}: no moment had every stream live")
        return out
    w0, w1 = window
    ms, frames = window_figures(streams, w0, w1)
    span = w1 - w0
    (e0, n0), (e1, n1) = _interpolate(samples, w0), _interpolate(samples, w1)
    out.update(
        {
            "window_s": span,
            "window_start_after_s": w0 - plan.start_at,
            "window_chunks_per_s": frames / span,
            "gap_p50_ms": pct(ms, 50),
            "gap_p90_ms": pct(ms, 90),
            "gap_p99_ms": pct(ms, 99),
            "gap_max_ms": max(ms) if ms else None,
            "node_cpu_us_per_chunk": (n1 - n0) * 1e6 / max(frames, 1),
            "saturated": frames / span < SATURATED_BELOW * count * rate,
        }
    )
    if via == "edge":
        out["edge_cpu_us_per_chunk"] = (e1 - e0) * 1e6 / max(frames, 1)
        out["edge_cores_busy"] = (e1 - e0) / span
    first = next((p["first_error"] for p in parts if p["first_error"]), None)
    if first:
        out["first_error"] = first
    if out["streams_ok"] < count:
        bench.log(f"  paced {via}: {out['streams_ok']} of {count} streams complete; {first}")
    return out
