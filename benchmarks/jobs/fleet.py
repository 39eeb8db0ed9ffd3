"""The fleet benchmark's job: sequences of streamed chat requests at a fixed concurrency.

`concurrency` lanes take requests from one queue, first the first request of every
sequence in order; once a sequence's request is answered, its next one (an agent's
next turn) joins the back of the queue, so the turns of a session are in order, with
other sessions' requests between them (the time a tool takes). Each request goes on
the lane's keep-alive connection to its sequence's target (sequence i to target i mod
the number of targets: two edges split the traffic). Per request it notes the status,
the time to the first content frame, the run id and the final usage frame's prompt
and cached tokens (the only frame parsed). Bounded by `timeout_s` as a whole.
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


def _usage(raw: bytes | None) -> tuple[int | None, int | None]:
    """(prompt_tokens, cached_tokens) of a usage frame; None where it says nothing."""
    if raw is None:
        return None, None
    try:
        usage = json.loads(raw).get("usage") or {}
    except (ValueError, AttributeError):
        return None, None
    details = usage.get("prompt_tokens_details") or {}
    prompt, cached = usage.get("prompt_tokens"), details.get("cached_tokens")
    return (
        prompt if isinstance(prompt, int) else None,
        cached if isinstance(cached, int) else (0 if isinstance(prompt, int) else None),
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
    record["prompt_tokens"], record["cached_tokens"] = _usage(reader.usage)
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

    c0, t0 = cpu(), time.monotonic()
    tasks = [asyncio.ensure_future(lane()) for _ in range(lanes)]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    wall = time.monotonic() - t0
    for task in pending:
        task.cancel()
    failures = [repr(t.exception())[:200] for t in done if t.exception() is not None]
    return {
        "wall_s": wall,
        "client_cpu_s": cpu() - c0,
        "records": records,
        "unfinished": left,
        "lane_failures": failures,
    }


def job_fleet(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(_fleet(**kwargs))


FLEET_JOBS: dict[str, JobFn] = {"fleet": job_fleet}
