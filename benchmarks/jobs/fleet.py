"""The fleet benchmark's job: sequences of streamed chat requests at a fixed concurrency.

`concurrency` lanes take requests from one queue, first the first request of every
sequence in order; once a sequence's request is answered, its next one (an agent's
next turn) joins the back of the queue, so the turns of a session are in order, with
other sessions' requests between them (the time a tool takes). Each request goes on
the lane's keep-alive connection to its sequence's target (sequence i to target i mod
the number of targets: two edges split the traffic). Per request it notes the status,
the time to the first content frame, the run id and the final usage frame's prompt,
cached and completion tokens (the only frame parsed). Bounded by `timeout_s` as a whole.

With `arrivals` (an open loop, `fleet_open`), each sequence's one request is sent at its
time from the start, whatever is still in flight: on an idle keep-alive connection to
its target, else a new one (at most `max_open` connections; past that a request waits
for one and is sent late, its lateness noted).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from benchmarks.httpclient import AioConnection, ResponseReader, build_post
from benchmarks.jobs.base import Ctl, JobFn

PATH = "/v1/chat/completions"
perf = time.perf_counter
cpu = time.process_time


def _usage(raw: bytes | None) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, cached_tokens, completion_tokens) of a usage frame; None where it
    says nothing."""
    if raw is None:
        return None, None, None
    try:
        usage = json.loads(raw).get("usage") or {}
    except (ValueError, AttributeError):
        return None, None, None
    details = usage.get("prompt_tokens_details") or {}
    prompt, cached = usage.get("prompt_tokens"), details.get("cached_tokens")
    completion = usage.get("completion_tokens")
    return (
        prompt if isinstance(prompt, int) else None,
        cached if isinstance(cached, int) else (0 if isinstance(prompt, int) else None),
        completion if isinstance(completion, int) else None,
    )


async def _one(
    conns: dict[int, AioConnection], targets: list[tuple[str, int]], which: int, payload: bytes,
    record: dict[str, Any],
) -> None:  # fmt: skip
    """One request on the lane's connection to target `which`; its figures into `record`."""
    host, port = targets[which]
    conn = conns.get(which)
    if conn is None or not conn.reusable:
        conn = conns[which] = await AioConnection.open(host, port)
    reader = ResponseReader(keep_usage=True)
    t0 = perf()
    try:
        await conn.request(build_post(host, port, PATH, payload), reader)
    except ConnectionError as exc:
        record["error"] = repr(exc)[:200]
        conns.pop(which, None)
        return
    record["total_ms"] = (perf() - t0) * 1e3
    if reader.first_content_at is not None:
        record["ttft_ms"] = (reader.first_content_at - t0) * 1e3
    record["status"] = reader.status
    record["run_id"] = reader.run_id
    record["end_s"] = perf()
    record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"] = _usage(
        reader.usage
    )
    if reader.status != 200 or reader.errors or not reader.done:
        record["error"] = f"HTTP {reader.status}: {reader.text()[:200]!r}"
    if reader.close:
        conn.close()
        conns.pop(which, None)


async def _fleet(
    targets: list[tuple[str, int]],
    sequences: list[list[bytes]],
    concurrency: int,
    timeout_s: float,
) -> dict[str, Any]:
    lanes = max(1, concurrency)
    queue: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
    for i in range(len(sequences)):
        queue.put_nowait((i, 0))
    left = sum(len(s) for s in sequences)
    records: list[dict[str, Any]] = []
    if not left:
        queue.put_nowait(None)

    async def lane() -> None:
        nonlocal left
        conns: dict[int, AioConnection] = {}
        try:
            while (item := await queue.get()) is not None:
                seq, turn = item
                which = seq % len(targets)
                record: dict[str, Any] = {"seq": seq, "turn": turn, "target": which}
                records.append(record)
                try:
                    await _one(conns, targets, which, sequences[seq][turn], record)
                except OSError as exc:
                    record["error"] = repr(exc)[:200]
                left -= 1
                if turn + 1 < len(sequences[seq]):
                    queue.put_nowait((seq, turn + 1))
                if not left:
                    queue.put_nowait(None)
            queue.put_nowait(None)  # the next lane stops too
        finally:
            for conn in conns.values():
                conn.close()

    c0, t0, p0 = cpu(), time.monotonic(), perf()
    tasks = [asyncio.ensure_future(lane()) for _ in range(lanes)]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    wall = time.monotonic() - t0
    for task in pending:
        task.cancel()
    for record in records:
        if "end_s" in record:
            record["end_s"] -= p0
    failures = [repr(t.exception())[:200] for t in done if t.exception() is not None]
    return {
        "wall_s": wall,
        "client_cpu_s": cpu() - c0,
        "records": records,
        "unfinished": left,
        "lane_failures": failures,
    }


async def _open_loop(
    targets: list[tuple[str, int]],
    sequences: list[list[bytes]],
    arrivals: list[float],
    timeout_s: float,
    max_open: int = 1024,
    target_of: list[int] | None = None,
) -> dict[str, Any]:
    """Sequence i's first request sent at `arrivals[i]` seconds from the start (the module
    says how), to target `target_of[i]` (default: i mod the number of targets); its
    record's `late_ms` is how far behind that it went out."""
    idle: list[list[AioConnection]] = [[] for _ in targets]
    slots = asyncio.Semaphore(max_open)
    records: list[dict[str, Any]] = []
    t0 = perf()

    async def send(seq: int) -> None:
        which = seq % len(targets) if target_of is None else target_of[seq]
        record: dict[str, Any] = {"seq": seq, "turn": 0, "target": which}
        records.append(record)
        async with slots:
            record["late_ms"] = (perf() - t0 - arrivals[seq]) * 1e3
            conns: dict[int, AioConnection] = {}
            if idle[which]:
                conns[which] = idle[which].pop()
            try:
                await _one(conns, targets, which, sequences[seq][0], record)
            except OSError as exc:
                record["error"] = repr(exc)[:200]
                conns.clear()
            kept = conns.get(which)
            if kept is not None and kept.reusable:
                idle[which].append(kept)
            elif kept is not None:
                kept.close()

    async def schedule() -> None:
        async with asyncio.TaskGroup() as group:
            for seq, at in enumerate(arrivals):
                wait = t0 + at - perf()
                if wait > 0:
                    await asyncio.sleep(wait)
                group.create_task(send(seq))

    c0 = cpu()
    failures: list[str] = []
    try:
        await asyncio.wait_for(schedule(), timeout_s)
    except TimeoutError:
        failures.append(f"not done within {timeout_s:g} s")
    except Exception as exc:  # a lane's own failure, reported as the closed loop does
        failures.append(repr(exc)[:200])
    wall = perf() - t0
    for conns in idle:
        for conn in conns:
            conn.close()
    for record in records:
        if "end_s" in record:
            record["end_s"] -= t0
    done = sum(1 for r in records if "status" in r or "error" in r)
    return {
        "wall_s": wall,
        "client_cpu_s": cpu() - c0,
        "records": records,
        "unfinished": len(arrivals) - done,
        "lane_failures": failures,
    }


def job_fleet(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(_fleet(**kwargs))


def job_fleet_open(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(_open_loop(**kwargs))


FLEET_JOBS: dict[str, JobFn] = {"fleet": job_fleet, "fleet_open": job_fleet_open}
