"""The asyncio jobs: the edge over raw HTTP/1.1 (`benchmarks.httpclient`), in a
load-generator process (`benchmarks.loadgen`). Each reports its own CPU time."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

from benchmarks.httpclient import AioConnection, ResponseReader
from benchmarks.jobs.base import Ctl, JobFn, max_backlog

mono = time.monotonic
perf = time.perf_counter
cpu = time.process_time


async def _sleep_until(when: float) -> None:
    delay = when - mono()
    if delay > 0:
        await asyncio.sleep(delay)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def _streams(
    host: str,
    port: int,
    request: bytes,
    count: int,
    connect_limit: int,
    start_at: float,
    timeout_s: float,
) -> dict[str, Any]:
    """`count` concurrent streams, each on a new connection; counts content frames."""
    gate = asyncio.Semaphore(connect_limit)
    ttfts: list[float] = []

    async def one() -> ResponseReader:
        async with gate:
            conn = await AioConnection.open(host, port)
        try:
            t0 = perf()
            reader = await conn.request(request, ResponseReader())
            if reader.first_content_at is not None:
                ttfts.append((reader.first_content_at - t0) * 1e3)
            return reader
        finally:
            conn.close()

    await _sleep_until(start_at)
    c0, t0 = cpu(), mono()
    tasks = [asyncio.ensure_future(one()) for _ in range(count)]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    t1, c1 = mono(), cpu()
    for task in pending:
        task.cancel()
    errors: list[str] = []
    chunks = incomplete = ok = writes = 0
    for task in done:
        exc = task.exception()
        if exc is not None:
            errors.append(repr(exc)[:200])
            continue
        reader = task.result()
        chunks += reader.content
        writes += reader.http_chunks
        if reader.status != 200 or not reader.done or reader.errors:
            incomplete += 1
        else:
            ok += 1
    return {
        "t_start": t0,
        "t_end": t1,
        "cpu_s": c1 - c0,
        "streams": count,
        "ok": ok,
        "incomplete": incomplete,
        "errors": len(errors),
        "unfinished": len(pending),
        "chunks": chunks,
        "http_chunks": writes,
        "ttft_p50_ms": _pct(ttfts, 50),
        "ttft_p99_ms": _pct(ttfts, 99),
        "first_error": errors[0] if errors else None,
    }


def job_streams(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(_streams(**kwargs))


async def _open_streams(
    ctl: Ctl,
    host: str,
    port: int,
    request: bytes,
    count: int,
    connect_limit: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Open `count` streams, read each to its first content frame, hold them, then close all.

    Reports once opened (progress), waits for the word to close, closes every socket
    (shutdown: the FIN leaves now) noting the time per run id, and returns those times.
    """
    gate = asyncio.Semaphore(connect_limit)
    held: list[tuple[AioConnection, str | None]] = []
    errors: list[str] = []
    statuses: dict[int, int] = {}

    async def open_one() -> None:
        async with gate:
            try:
                conn = await AioConnection.open(host, port)
            except OSError as exc:
                errors.append(repr(exc)[:200])
                return
            reader = ResponseReader(stop_after=1)
            try:
                await conn.request(request, reader)
            except ConnectionError as exc:
                errors.append(repr(exc)[:200])
                conn.close()
                return
            if reader.status != 200 or reader.run_id is None or not reader.content:
                errors.append(f"HTTP {reader.status}: {b''.join(reader.body)[:200]!r}")
                statuses[reader.status] = statuses.get(reader.status, 0) + 1
            held.append((conn, reader.run_id))

    c0, t0 = cpu(), mono()
    tasks = [asyncio.ensure_future(open_one()) for _ in range(count)]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    ctl.send(
        {
            "opened": len(held),
            "errors": len(errors),
            "unfinished": len(pending),
            "open_s": mono() - t0,
            "cpu_s": cpu() - c0,
            "bad_statuses": statuses,
            "first_error": errors[0] if errors else None,
        }
    )
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, ctl.recv, timeout_s)
    closed: dict[str, float] = {}
    for conn, run_id in held:
        transport = conn.transport
        assert transport is not None
        sock = transport.get_extra_info("socket")
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        if run_id is not None:
            closed[run_id] = mono()
        transport.abort()
    await asyncio.sleep(0)
    return {"closed": closed}


def job_open_streams(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(_open_streams(ctl, **kwargs))


async def _rate(
    host: str,
    port: int,
    request: bytes,
    rate: float,
    seconds: float,
    start_at: float,
    max_conns: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Open loop: request i is due at start + i/rate; latency is counted from that time."""
    idle: asyncio.Queue[AioConnection] = asyncio.Queue()
    opened = 0
    latencies: list[float] = []
    errors: list[str] = []
    for _ in range(min(max_conns, max(4, int(rate / 50)))):
        idle.put_nowait(await AioConnection.open(host, port))
        opened += 1

    async def one(due: float) -> None:
        nonlocal opened
        conn: AioConnection | None = None
        try:
            if not idle.empty():
                conn = idle.get_nowait()
            elif opened < max_conns:
                opened += 1
                conn = await AioConnection.open(host, port)
            else:
                conn = await idle.get()
            reader = await conn.request(request, ResponseReader(keep_body=True))
            end = mono()
            if reader.status != 200 or b'"chat.completion"' not in reader.text():
                errors.append(f"HTTP {reader.status}: {reader.text()[:200]!r}")
                return
            latencies.append((end - due) * 1e3)
            if reader.close:
                conn.close()
                opened -= 1
            else:
                idle.put_nowait(conn)
                conn = None
        except (OSError, ConnectionError) as exc:
            errors.append(repr(exc)[:200])
            if conn is not None:
                conn.close()
                opened -= 1

    n = int(rate * seconds)
    tasks: list[asyncio.Task[None]] = []
    backlog = max_backlog(rate)
    stopped_at: float | None = None
    await _sleep_until(start_at)
    c0, t0 = cpu(), mono()
    stop_by = t0 + seconds + timeout_s
    for i in range(n):
        due = t0 + i / rate
        await _sleep_until(due)
        if len(tasks) - len(latencies) - len(errors) > backlog or mono() > stop_by:
            stopped_at = mono() - t0  # saturated: stop, do not queue seconds of backlog
            break
        tasks.append(asyncio.ensure_future(one(due)))
    _, pending = await asyncio.wait(tasks, timeout=max(1.0, stop_by - mono()))
    t1, c1 = mono(), cpu()
    for task in pending:
        task.cancel()
    while not idle.empty():
        idle.get_nowait().close()
    return {
        "t_start": t0,
        "t_end": t1,
        "cpu_s": c1 - c0,
        "requests": n,
        "latencies_ms": latencies,
        "errors": len(errors),
        "unfinished": len(pending) + n - len(tasks),
        "connections": opened,
        "stopped_at_s": stopped_at,
        "first_error": errors[0] if errors else None,
    }


def job_rate(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(_rate(**kwargs))


async def _closed(
    host: str,
    port: int,
    request: bytes,
    conns: int,
    seconds: float,
    start_at: float,
    timeout_s: float,
) -> dict[str, Any]:
    """Closed loop: `conns` keep-alive connections, each sending its next request as soon
    as the last one was answered, for `seconds`; a throughput, not a latency, figure."""
    opened = [await AioConnection.open(host, port) for _ in range(conns)]
    done = errors = 0
    first_error: str | None = None
    await _sleep_until(start_at)
    c0, t0 = cpu(), mono()
    stop = t0 + seconds

    async def loop(conn: AioConnection) -> None:
        nonlocal done, errors, first_error
        while mono() < stop:
            try:
                reader = await asyncio.wait_for(conn.request(request, ResponseReader()), timeout_s)
            except (OSError, ConnectionError, TimeoutError) as exc:
                errors += 1
                first_error = first_error or repr(exc)[:200]
                return
            if reader.status != 200:
                errors += 1
                first_error = first_error or f"HTTP {reader.status}"
            else:
                done += 1
            if reader.close:
                return

    await asyncio.gather(*(loop(conn) for conn in opened))
    t1, c1 = mono(), cpu()
    for conn in opened:
        conn.close()
    return {
        "t_start": t0,
        "t_end": t1,
        "cpu_s": c1 - c0,
        "requests": done,
        "errors": errors,
        "first_error": first_error,
    }


def job_closed(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(_closed(**kwargs))


AIO_JOBS: dict[str, JobFn] = {
    "closed": job_closed,
    "streams": job_streams,
    "open_streams": job_open_streams,
    "rate": job_rate,
}
