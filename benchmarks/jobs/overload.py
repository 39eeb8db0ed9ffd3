"""The overload curve's load-generator job: requests offered closed or open loop.
The orchestrator's side, and what the curve means, are in `benchmarks.overload`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.httpclient import AioConnection, ResponseReader
from benchmarks.jobs.base import Ctl

mono = time.monotonic
cpu = time.process_time


def _kind(reader: ResponseReader) -> str:
    if reader.status == 200 and b'"chat.completion"' in reader.text():
        return "ok"
    if reader.status == 503:
        return "shed"
    return f"http_{reader.status}"


async def _overload(
    host: str,
    port: int,
    request: bytes,
    mode: str,
    rate: float,
    clients: int,
    seconds: float,
    start_at: float,
    timeout_s: float,
) -> dict[str, Any]:
    """`mode` "closed": `clients` loops for `seconds`; "open": `rate` requests/s for `seconds`.

    Returns one record per request: [due offset s, end offset s, latency ms, kind,
    typed overloaded with Retry-After], plus the start lags and the job's CPU time.
    """
    idle: list[AioConnection] = []
    records: list[list[Any]] = []
    lags: list[float] = []
    errors: list[str] = []
    t0 = 0.0

    async def one(due: float) -> None:
        conn = idle.pop() if idle else None
        try:
            if conn is None:
                conn = await AioConnection.open(host, port)
            reader = await conn.request(request, ResponseReader(keep_body=True))
            end = mono()
            kind = _kind(reader)
            typed = kind == "shed" and (
                reader.retry_after is not None and b'"overloaded"' in reader.text()
            )
            records.append([due - t0, end - t0, (end - due) * 1e3, kind, typed])
            if reader.close:
                conn.close()
            else:
                idle.append(conn)
            conn = None
        except (OSError, ConnectionError) as exc:
            errors.append(repr(exc)[:200])
            records.append([due - t0, mono() - t0, None, "broken", False])
            if conn is not None:
                conn.close()

    delay = start_at - mono()
    if delay > 0:
        await asyncio.sleep(delay)
    c0, t0 = cpu(), mono()
    tasks: list[asyncio.Task[None]] = []
    if mode == "closed":

        async def loop() -> None:
            while mono() - t0 < seconds:
                before = len(records)
                await one(mono())
                if records[before:] and records[-1][3] != "ok":
                    await asyncio.sleep(0.01)  # refused: do not spin on it

        tasks = [asyncio.ensure_future(loop()) for _ in range(clients)]
    else:
        for i in range(int(rate * seconds)):
            due = t0 + i / rate
            wait = due - mono()
            if wait > 0:
                await asyncio.sleep(wait)
            lags.append((mono() - due) * 1e3)
            tasks.append(asyncio.ensure_future(one(due)))
    sent_span = mono() - t0
    _, pending = await asyncio.wait(tasks, timeout=seconds + timeout_s) if tasks else ((), ())
    for task in pending:
        task.cancel()
    for conn in idle:
        conn.close()
    return {
        "records": records,
        "lags_ms": lags,
        "sent_span_s": sent_span,
        "cpu_s": cpu() - c0,
        "wall_s": mono() - t0,
        "unfinished": len(pending),
        "first_error": errors[0] if errors else None,
    }


def job_overload(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(_overload(**kwargs))


OVERLOAD_JOBS = {"overload": job_overload}
