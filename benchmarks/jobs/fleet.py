"""The fleet benchmark's job: sequences of streamed chat requests at a fixed concurrency.

`concurrency` lanes take sequences from one queue in order; a lane plays a sequence's
bodies one after the other (an agent's turns), each on the lane's keep-alive connection
to the sequence's target (sequence i goes to target i mod the number of targets: two
edges split the traffic). Per request it notes the status, the time to the first
content frame, the run id and the final usage frame's prompt and cached tokens (the
only frame parsed). Bounded by `timeout_s` as a whole.
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


async def _fleet(
    targets: list[tuple[str, int]],
    sequences: list[list[bytes]],
    concurrency: int,
    timeout_s: float,
) -> dict[str, Any]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(sequences)):
        queue.put_nowait(i)
    records: list[dict[str, Any]] = []

    async def lane() -> None:
        conns: dict[int, AioConnection] = {}
        try:
            while not queue.empty():
                seq = queue.get_nowait()
                which = seq % len(targets)
                host, port = targets[which]
                for turn, payload in enumerate(sequences[seq]):
                    record: dict[str, Any] = {"seq": seq, "turn": turn, "target": which}
                    records.append(record)
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
                        continue
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
        finally:
            for conn in conns.values():
                conn.close()

    c0, t0 = cpu(), time.monotonic()
    tasks = [asyncio.ensure_future(lane()) for _ in range(max(1, concurrency))]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    wall = time.monotonic() - t0
    for task in pending:
        task.cancel()
    failures = [repr(t.exception())[:200] for t in done if t.exception() is not None]
    return {
        "wall_s": wall,
        "client_cpu_s": cpu() - c0,
        "records": records,
        "unfinished": len(pending),
        "lane_failures": failures,
    }


def job_fleet(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(_fleet(**kwargs))


FLEET_JOBS: dict[str, JobFn] = {"fleet": job_fleet}
