"""`--calls`: the edge's function calls per request, counted by cProfile: exact figures,
no calibration, for this tree alone or against git revision REV (`--calls --ab REV`).

Each run is a fresh stack (`benchmarks.stack.Stack`: this tree's simulated node, an edge
of its own) whose edge runs under `python -P benchmarks/threadprofile.py FILE -m edge`
(cProfile on every thread: the edge prepares a request in a worker thread); one client
sends the warm-up requests, then N, one at a time on a keep-alive connection, and the
edge gets a SIGTERM: it drains, exits, and the profiles are written. A workload runs
twice per tree, with `small` and `large` requests after the same warm-up; the
difference of the two runs' calls over `large - small` is the calls per request
(`benchmarks.callstats.per_request`): start-up, warm-up and shutdown cancel out.

The workloads: a non-streamed request (`SHORT_SCRIPT`) and streams of N zero-delay
deltas (`streamN`); per chunk, the longest stream's calls over its chunks, and the
marginal figure: the longest and the shortest streams' difference over their chunks'.

A REV is checked out as `--ab` does (`benchmarks.ab.checkout`: a git worktree in the
run's temporary directory, on this venv or a venv of its own) and removed at the end;
the runs alternate A and B, workload by workload. Only the edge changes sides. What a
run starts, `Stack` stops, however the run ends (`benchmarks.cleanup`).
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.ab import checkout, edge_module_path, remove_checkout, tree_label
from benchmarks.callstats import Key, areas, differences, load, merged, per_request, total
from benchmarks.cleanup import stop
from benchmarks.httpclient import ResponseReader, build_post
from benchmarks.report import fmt, sig, table
from benchmarks.scripts import SHORT_SCRIPT, chat_body, long_script
from benchmarks.stack import EdgeSource, Stack

ROOT = Path(__file__).resolve().parent.parent
THREADPROFILE = Path(__file__).resolve().parent / "threadprofile.py"
REQUEST_TIMEOUT_S = 60.0
# The edge drains (2 s in the stack's config), then its profiles are written.
EXIT_TIMEOUT_S = 60.0
Log = Callable[[str], None]
CAVEAT = (
    "Call counts are a proxy for CPU: a C builtin and a Python function count 1 each, "
    "whatever they cost. They vary by a few percent from run to run with how events "
    "batch (how many pass through one scheduler pass, one read, one write), and time-driven "
    "work (timers, the node's state) adds calls by the run's length, not its requests."
)


@dataclass(frozen=True)
class Workload:
    """A non-streamed request (`chunks` 0) or a stream of `chunks` zero-delay deltas."""

    chunks: int = 0

    @property
    def name(self) -> str:
        return f"stream{self.chunks}" if self.chunks else "nonstream"

    @property
    def label(self) -> str:
        return f"stream of {self.chunks} chunks" if self.chunks else "non-stream request"

    def body(self) -> bytes:
        script = long_script(self.chunks) if self.chunks else SHORT_SCRIPT
        return chat_body(script, stream=bool(self.chunks))


def workloads(text: str) -> tuple[Workload, ...]:
    """`nonstream,stream20,stream200` -> the workloads, in that order."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if item == "nonstream":
            out.append(Workload())
        elif item.startswith("stream") and item[6:].isdigit() and int(item[6:]) > 0:
            out.append(Workload(int(item[6:])))
        elif item:
            raise ValueError(f"{item!r}: a workload is nonstream or streamN (N chunks)")
    if not out:
        raise ValueError("no workload")
    return tuple(out)


@dataclass(frozen=True)
class CallSettings:
    small: int = 200
    large: int = 1200
    warmup: int = 100
    workloads: tuple[Workload, ...] = (Workload(), Workload(20), Workload(200))
    top: int = 15


@dataclass(frozen=True)
class Run:
    """One profiled edge: its calls per function (every thread; `threads`: those other
    than the main one, the event loop's), and what its client saw."""

    requests: int
    calls: dict[Key, int]
    threads: dict[Key, int]
    frames_per_request: float
    seconds: float

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "calls": sum(self.calls.values()),
            "calls_other_threads": sum(self.threads.values()),
            "content_frames_per_request": sig(self.frames_per_request),
            "seconds": sig(self.seconds),
        }


def profiled(source: EdgeSource, out: Path) -> EdgeSource:
    """`source`'s edge under cProfile, every thread (`benchmarks.threadprofile`), writing
    `out` (the main thread) and `out`.threads (the others). `-P`: the script's folder is
    not put first on sys.path, so the edge is the one `source` names."""
    python = str(Path(source.command[0]).parent / "python") if source.command else sys.executable
    command = (python, "-P", str(THREADPROFILE), str(out), "-m", "edge")
    return EdgeSource(label=source.label, command=command, env=source.env)


def serve(port: int, workload: Workload, warmup: int, n: int) -> int:
    """`warmup`, then `n` requests, one at a time on a keep-alive connection (a new one
    when the edge closes it: hypercorn's keep_alive_max_requests); returns the content
    frames of the `n`. Any answer but a whole 200 stops the run."""
    data = build_post("127.0.0.1", port, "/v1/chat/completions", workload.body())
    frames = 0
    sock = None
    try:
        for i in range(warmup + n):
            if sock is None:
                sock = socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT_S)
            reader = ResponseReader()
            sock.sendall(data)
            while not reader.feed(chunk := sock.recv(65536)):
                if not chunk:
                    raise RuntimeError("the edge closed the connection during a response")
            if reader.status != 200 or reader.errors or (workload.chunks and not reader.done):
                raise RuntimeError(f"{workload.label}: {reader.status}: {reader.text()[:300]!r}")
            if i >= warmup:
                frames += reader.content
            if reader.close:
                sock.close()
                sock = None
    finally:
        if sock is not None:
            sock.close()
    return frames


def profile_run(
    source: EdgeSource,
    workload: Workload,
    n: int,
    s: CallSettings,
    where: Path,
    roots: Sequence[str],
) -> Run:
    """A fresh stack, `s.warmup` + `n` requests of `workload`; the edge stopped, its
    profile read."""
    where.mkdir(parents=True)
    out = where / "edge.prof"
    started = time.monotonic()
    with Stack(where, profiled(source, out)) as stack:
        frames = serve(stack.edge_port, workload, s.warmup, n)
        code = stop(stack.edge, wait_s=EXIT_TIMEOUT_S)
        threads = Path(f"{out}.threads")
        if code != 0 or not out.exists() or not threads.exists():
            raise RuntimeError(f"the profiled edge exited with {code}: {stack.edge_log()[-800:]}")
    main, others = load(out, roots), load(threads, roots)
    seconds = time.monotonic() - started
    return Run(n, merged(main, others), others, frames / n if n else 0.0, seconds)


def measure_workload(
    workload: Workload, sides: dict[str, EdgeSource], s: CallSettings, tmp: Path,
    roots: Sequence[str], log: Log,
) -> dict[str, Any]:  # fmt: skip
    """Both runs of `workload` on each side (A, B, A, B); its calls per request."""
    runs: dict[str, list[Run]] = {side: [] for side in sides}
    for n in (s.small, s.large):
        for side, source in sides.items():
            log(f"calls: {workload.label}, {s.warmup} + {n} requests, {side} = {source.label}")
            where = tmp / f"{workload.name}-{n}-{side}"
            runs[side].append(profile_run(source, workload, n, s, where, roots))
    out: dict[str, Any] = {"name": workload.name, "label": workload.label}
    out["chunks"] = workload.chunks
    per: dict[str, dict[Key, float]] = {}
    out["sides"] = {}
    for side, (small, large) in runs.items():
        per[side] = per_request(small.calls, large.calls, s.large - s.small)
        threads = per_request(small.threads, large.threads, s.large - s.small)
        out["sides"][side] = {
            "per_request": sig(total(per[side]), 6),
            "other_threads": sig(total(threads), 6),
            "runs": [small.summary(), large.summary()],
            "areas": {k: sig(v) for k, v in areas(per[side]).items() if abs(v) >= 0.05},
        }
    if "B" in per:
        top = differences(per["A"], per["B"], s.top)
        out["differences"] = [{**asdict(d), "delta": sig(d.delta)} for d in top]
    return out


def run_calls(rev: str | None, s: CallSettings, tmp: Path, log: Log) -> dict[str, Any]:
    """This tree's calls per request (A), and REV's (B) when given."""
    if s.large <= s.small or s.small < 0 or s.warmup < 0:
        raise ValueError("--calls-requests SMALL,LARGE needs 0 <= SMALL < LARGE")
    # This tree's edge is this tree's code, whatever PYTHONPATH or the venv would import.
    sides = {"A": EdgeSource(label=tree_label(), env=(("PYTHONPATH", str(ROOT)),))}
    result: dict[str, Any] = {"settings": {**asdict(s), "workloads": [w.name for w in s.workloads]}}
    where = None
    try:
        if rev:
            sha, where, sides["B"] = checkout(rev, tmp)
            result.update(rev=rev, sha=sha)
        result["labels"] = {side: source.label for side, source in sides.items()}
        result["edge_code"] = {side: edge_module_path(src) for side, src in sides.items()}
        # Where each side's `edge` is: its files compare by their path under it.
        roots = [str(Path(code).parent.parent) for code in result["edge_code"].values()]
        result["workloads"] = [measure_workload(w, sides, s, tmp, roots, log) for w in s.workloads]
    finally:
        if where is not None:
            remove_checkout(where)
    return result


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.1f}%" if b else "-"


def _rows(result: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """(figure, {side: calls}): per request; per chunk of the longest stream, and between
    the shortest and the longest (what one more chunk costs)."""
    rows = []
    streams = []
    for w in result["workloads"]:
        per = {side: v["per_request"] for side, v in w["sides"].items()}
        rows.append((f"{w['label']}: per request" if w["chunks"] else w["label"], per))
        if w["chunks"]:
            streams.append((w["chunks"], w["label"], per))
    if streams:
        chunks, label, per = max(streams, key=lambda x: x[0])
        rows.append((f"{label}: per chunk", {k: v / chunks for k, v in per.items()}))
        lo, _, low = min(streams, key=lambda x: x[0])
        if chunks > lo:
            marginal = {k: (per[k] - low[k]) / (chunks - lo) for k in per}
            rows.append((f"per chunk, {chunks} - {lo} chunks", marginal))
    return rows


def render_calls(result: dict[str, Any]) -> str:
    s = result["settings"]
    labels = result["labels"]
    sides = list(labels)
    lines = [
        "",
        "Function calls per request (cProfile, every thread of the edge; "
        f"{result.get('elapsed_s', 0):.0f} s): runs of {s['small']:,} and {s['large']:,} "
        f"requests after {s['warmup']:,} warm-up, each a fresh edge; (the second's calls - "
        f"the first's) / {s['large'] - s['small']:,}.",
        ", ".join(f"{side} = {labels[side]}" for side in sides),
        "edge code: " + ", ".join(f"{side} imports {result['edge_code'][side]}" for side in sides),
        "",
    ]
    headers = ["figure", *sides] + (["A vs B"] if "B" in labels else [])
    rows = []
    for figure, per in _rows(result):
        row = [figure, *(fmt(per[side]) for side in sides)]
        rows.append(row + ([_pct(per["A"], per["B"])] if "B" in labels else []))
    lines += [table(headers, rows), "", CAVEAT, ""]
    lines += [_runs(w, sides) for w in result["workloads"]]
    lines += ["", *_areas(result["workloads"], "B" in labels)]
    for w in result["workloads"]:
        if "differences" in w:
            lines += ["", *_differences(w)]
    return "\n".join(lines)


def _runs(w: dict[str, Any], sides: list[str]) -> str:
    """Per side: the calls per request in threads other than the event loop's, the
    long run's length, and the frames a stream came in."""
    parts = []
    for side in sides:
        figures = w["sides"][side]
        run = figures["runs"][-1]
        text = f"{side}: {fmt(figures.get('other_threads'))} in other threads"
        text += f", {run['requests']:,} requests in {run['seconds']:.0f} s"
        if w["chunks"]:
            text += f", {run['content_frames_per_request']:g} content frames each"
        parts.append(text)
    return f"{w['label']}: " + "; ".join(parts)


def _differences(w: dict[str, Any]) -> list[str]:
    rows = [
        [f"{d['delta']:+,.1f}", fmt(d["a"]) if d["only"] != "B" else "-",
         fmt(d["b"]) if d["only"] != "A" else "-",
         f"{d['file']}:{d['name']}" + _mark(d)]
        for d in w["differences"]
    ]  # fmt: skip
    title = (
        f"{w['label']}: the {len(rows)} functions whose calls per request differ most "
        "(new: only in A's profiles; gone: only in B's; B: B's file of a function that moved)"
    )
    return [title, table(["A - B", "A", "B", "function"], rows)]


def _mark(d: dict[str, Any]) -> str:
    if d.get("moved_from"):
        return f" (B: {d['moved_from']})"
    return {"A": " (new)", "B": " (gone)", None: ""}[d["only"]]


def _areas(ws: list[dict[str, Any]], ab: bool, top: int = 14) -> list[str]:
    """Calls per request by package (A's; with B, A - B in brackets), the first
    workload's largest first."""
    names = list(ws[0]["sides"]["A"]["areas"])[:top]
    rows = []
    for name in names:
        row = [name]
        for w in ws:
            a = w["sides"]["A"]["areas"].get(name, 0.0)
            cell = fmt(a)
            if ab:
                cell += f" ({a - w['sides']['B']['areas'].get(name, 0.0):+,.0f})"
            row.append(cell)
        rows.append(row)
    title = "calls per request by package" + (" (A; A - B in brackets)" if ab else "")
    return [title, table(["package", *(w["label"] for w in ws)], rows)]
