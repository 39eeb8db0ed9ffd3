"""`python -m tests.chaos.cancelrace`: CancelRuns the edge sends for runs the node finished.

    python -m tests.chaos.cancelrace --rounds 5

The departing-client race, counted. Each round starts a fresh `iop-sim-node`
and `iop-edge` (real processes on 127.0.0.1) and sends `--streams` streaming
requests at once, each a script of `--deltas` deltas `--sleep-ms` apart
then `complete`; half the clients (drawn from the seed) close their
connection (a FIN) right after a random content chunk. Under that burst the
edge reads behind the node, so when a client leaves, its run may be over on
the node already, its terminal on its way to the edge.

Per round, from the node's runs log (the node's word, not the edge's):

- `finished+cancel`: CancelRuns that reached a run the node had finished: a
  run whose outcome is `complete` with `cancel_rpcs > 0`, plus each
  CancelRun for an id the node no longer knew (`{"type": "cancel_rpc",
  "found": false}`); split by when the node ended the run (its runs log's
  `ended_at`) against when its client closed the connection (same machine,
  same clock): before (the terminal was on its way when the client left:
  the edge should have taken it) or after (the node was still generating
  when the client left; the CancelRun crossed its terminal);
- `unfinished`: abandoned runs the node had not finished (outcome
  `cancelled`), and how many of them got exactly one CancelRun (every one
  must);
- `taken`: abandoned runs the node finished that got no CancelRun;
- `read`: clients that read their stream to the end (`[DONE]`), of those
  that did not leave.

The last line sums the rounds and checks the goal: at most `--goal`
CancelRuns for runs the node ended before their client left, over all the
rounds, and no abandoned unfinished run without exactly one CancelRun.
Exits 0 when it holds.
`--edge-src DIR` runs the edge of another checkout (same venv) for an A/B
comparison; the node and the clients are always this tree's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from benchmarks.cleanup import remove_dir, run_program, run_trio, temp_dir
from tests.chaos.client import StreamResult, run_stream
from tests.chaos.plan import Cut, Expect, Plan
from tests.chaos.procs import EdgeProcess, ProcessError, SimNode

# Generous: no deadline may end a run in this scenario, only the clients leaving.
TIMEOUTS = {"first_event_s": 10.0, "idle_s": 10.0, "total_s": 30.0}
# How long a round's runs log may take to hold every run (a run that ended without
# CancelRun waits up to a second for one before its line is written).
SETTLE_S = 10.0
LOAD_BOUND_S = 60.0


@dataclass(frozen=True, slots=True)
class Tally:
    """What one round's runs log says."""

    streams: int
    abandoned: int
    finished_cancelled: int  # outcome complete, cancel_rpcs > 0
    unknown_cancels: int  # CancelRuns for an id the node no longer knew
    # Of those, runs the node had ended before their client left (the terminal on its
    # way), and the others (the node ended them while the CancelRun travelled).
    before_leave: int
    unfinished: int  # abandoned, outcome not complete
    unfinished_one: int  # ... with exactly one CancelRun
    taken: int  # abandoned, complete, no CancelRun
    read: int  # clients that stayed and read to the end
    stayed: int
    missing: int  # runs with no runs-log line
    edge_cpu_s: float = 0.0

    @property
    def finished_cancels(self) -> int:
        return self.finished_cancelled + self.unknown_cancels

    def line(self, label: str) -> str:
        return (
            f"{label}: finished+cancel={self.finished_cancels}"
            f" (complete+cancel {self.finished_cancelled}, unknown id {self.unknown_cancels};"
            f" ended before the client left {self.before_leave},"
            f" crossed {self.finished_cancels - self.before_leave})"
            f" | abandoned {self.abandoned}: unfinished={self.unfinished}"
            f" with one cancel {self.unfinished_one}"
            f" (missed/extra {self.unfinished - self.unfinished_one}), taken={self.taken}"
            f" | read {self.read}/{self.stayed} | no line {self.missing}"
            f" | edge cpu {self.edge_cpu_s:.2f}s"
        )


def script(deltas: int, sleep_ms: int) -> str:
    events: list[dict[str, Any]] = []
    for i in range(deltas):
        events.append({"type": "delta", "delta": f"t{i} "})
        if sleep_ms:
            events.append({"sleep_ms": sleep_ms})
    usage = {"output_tokens": deltas}
    events.append({"type": "complete", "usage": usage, "metadata": {"finish_reason": "stop"}})
    return json.dumps({"events": events}, separators=(",", ":"))


def plans(rng: random.Random, streams: int, deltas: int, sleep_ms: int) -> list[Plan]:
    """`streams` plans; half (drawn) leave after a random content chunk, 1..deltas."""
    text = script(deltas, sleep_ms)
    messages = [{"role": "user", "content": text}]
    request = {"model": "sim-script", "stream": True, "messages": messages}
    leaving = set(rng.sample(range(streams), streams // 2))
    out = []
    for i in range(streams):
        cut = Cut(after_content=rng.randint(1, deltas)) if i in leaving else None
        expect = Expect(terminal="cut" if cut else "finish:stop", node_outcome="", edge_status="")
        out.append(Plan(index=i, kind="race", request=request, expect=expect, cut=cut))
    return out


def runs_log_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def one_round(
    workdir: Path, rng: random.Random, args: argparse.Namespace, source: Path | None
) -> Tally:
    node = SimNode("n1", workdir)
    edge = EdgeProcess(workdir, timeouts=dict(TIMEOUTS), source=source)
    try:
        await node.start()
        await edge.start([node])
        results = [
            StreamResult(plan, f"race-{plan.index}")
            for plan in plans(rng, args.streams, args.deltas, args.sleep_ms)
        ]
        cpu0 = edge.cpu_seconds()
        t0 = trio.current_time()
        wall0 = time.time()
        with trio.move_on_after(LOAD_BOUND_S):
            async with trio.open_nursery() as nursery:
                for result in results:
                    nursery.start_soon(run_stream, result, edge.port, t0)
        cpu = edge.cpu_seconds() - cpu0
        run_ids = {r.run_id for r in results if r.run_id}
        with trio.move_on_after(SETTLE_S):
            while True:
                logged = {
                    line["run_id"]
                    for line in runs_log_lines(node.runs_logs[-1])
                    if "outcome" in line
                }
                if run_ids <= logged and await edge.in_flight() == 0:
                    break
                await trio.sleep(0.1)  # another process's file: poll, bounded
    finally:
        await edge.stop()
        await node.stop()
    lines = runs_log_lines(node.runs_logs[-1])
    runs = {line["run_id"]: line for line in lines if "outcome" in line}
    unknown_ids = [
        line["run_id"] for line in lines if line.get("type") == "cancel_rpc" and not line["found"]
    ]
    unknown = len(unknown_ids)
    finished_cancelled = unfinished = unfinished_one = taken = read = stayed = missing = 0
    before_leave = 0
    by_run = {r.run_id: r for r in results if r.run_id}
    for run_id in unknown_ids:
        run, left = runs.get(run_id), by_run.get(run_id)
        if run and left and run["ended_at"] < wall0 + left.t_end:
            before_leave += 1
    for result in results:
        run = runs.get(result.run_id or "")
        if run is None:
            missing += 1
            continue
        complete = run["outcome"] == "complete"
        if complete and run["cancel_rpcs"]:
            finished_cancelled += 1
            before_leave += run["ended_at"] < wall0 + result.t_end
        if result.plan.cut is None:
            stayed += 1
            read += result.read_to_end and bool(result.payloads) and result.payloads[-1] == "[DONE]"
        elif complete:
            taken += not run["cancel_rpcs"]
        else:
            unfinished += 1
            unfinished_one += run["cancel_rpcs"] == 1
    return Tally(
        streams=len(results),
        abandoned=sum(1 for r in results if r.plan.cut is not None),
        finished_cancelled=finished_cancelled,
        unknown_cancels=unknown,
        before_leave=before_leave,
        unfinished=unfinished,
        unfinished_one=unfinished_one,
        taken=taken,
        read=read,
        stayed=stayed,
        missing=missing,
        edge_cpu_s=cpu,
    )


async def run_rounds(args: argparse.Namespace, source: Path | None) -> list[Tally]:
    rng = random.Random(args.seed)
    tallies = []
    for n in range(args.rounds):
        workdir = temp_dir(f"cancelrace-{n}-", keep=args.keep_logs)
        try:
            tally = await one_round(workdir, rng, args, source)
        finally:
            if not args.keep_logs:
                remove_dir(workdir)
        print(tally.line(f"round {n + 1}"), flush=True)
        tallies.append(tally)
    return tallies


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tests.chaos.cancelrace", description=__doc__.splitlines()[0]
    )
    p.add_argument("--rounds", type=int, default=5, help="rounds, each a fresh node and edge")
    p.add_argument("--streams", type=int, default=100, help="streams at once per round")
    p.add_argument("--deltas", type=int, default=40, help="deltas per stream")
    p.add_argument("--sleep-ms", type=int, default=1, help="the node's pause after each delta")
    p.add_argument("--seed", type=int, default=1, help="which clients leave, and where")
    p.add_argument(
        "--goal", type=int, default=2, help="CancelRuns for runs ended before their client left"
    )
    p.add_argument("--edge-src", default="", help="run the edge of this checkout (A/B)")
    p.add_argument("--keep-logs", action="store_true", help="keep each round's work directory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.streams < 2 or args.deltas < 1 or args.sleep_ms < 0:
        print("cancelrace: --rounds >= 1, --streams >= 2, --deltas >= 1", file=sys.stderr)
        return 2
    try:
        source = Path(args.edge_src).resolve() if args.edge_src else None
        tallies = run_trio(run_rounds, args, source)
    except ProcessError as exc:
        print(f"cancelrace: {exc}", file=sys.stderr)
        return 2
    finished = sum(t.finished_cancels for t in tallies)
    before = sum(t.before_leave for t in tallies)
    unfinished = sum(t.unfinished for t in tallies)
    missed = sum(t.unfinished - t.unfinished_one for t in tallies)
    ok = before <= args.goal and missed == 0
    per_round = " ".join(f"{t.before_leave}+{t.finished_cancels - t.before_leave}" for t in tallies)
    print(
        f"total: {finished} CancelRuns for finished runs over {len(tallies)} rounds,"
        f" {before} for runs ended before their client left (goal <= {args.goal}),"
        f" {finished - before} crossed (per round, before+crossed: {per_round});"
        f" {unfinished} unfinished abandoned runs, {missed} without exactly one CancelRun:"
        f" {'ok' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_program(main, "cancelrace"))
