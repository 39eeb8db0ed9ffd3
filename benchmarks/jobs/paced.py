"""The paced workload's load-generator jobs: this worker's share of the paced streams,
through the edge (raw HTTP/1.1) or through the node client (trio). The orchestrator's
side, and what the figures mean, are in `benchmarks.paced`."""

from __future__ import annotations

import asyncio
import time
from array import array
from typing import Any

from benchmarks.httpclient import AioConnection, ResponseReader
from benchmarks.jobs.base import Ctl, JobFn

mono = time.monotonic
cpu = time.process_time


def _report(
    t0: float,
    t1: float,
    c0: float,
    c1: float,
    count: int,
    per_stream: list[list[float]],
    ok: int,
    errors: list[str],
    unfinished: int,
) -> dict[str, Any]:
    flat: array[float] = array("d")
    for stamps in per_stream:
        flat.extend(stamps)
    return {
        "t_start": t0,
        "t_end": t1,
        "cpu_s": c1 - c0,
        "streams": count,
        "ok": ok,
        "errors": len(errors),
        "unfinished": unfinished,
        "chunks": len(flat),
        "stamps": flat.tobytes(),
        "lengths": [len(s) for s in per_stream],
        "first_error": errors[0] if errors else None,
    }


async def _paced_edge(
    host: str,
    port: int,
    request: bytes,
    count: int,
    offset: int,
    total: int,
    start_at: float,
    ramp_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    """This worker's share of the paced streams through the edge (raw HTTP/1.1)."""
    per_stream: list[list[float]] = []
    errors: list[str] = []
    ok = 0

    async def one(i: int) -> None:
        nonlocal ok
        delay = start_at + ramp_s * (offset + i) / max(total, 1) - mono()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            conn = await AioConnection.open(host, port)
        except OSError as exc:
            errors.append(repr(exc)[:200])
            return
        reader = ResponseReader(stamps=True)
        try:
            await conn.request(request, reader)
        except ConnectionError as exc:
            errors.append(repr(exc)[:200])
        finally:
            conn.close()
            assert reader.stamps is not None
            per_stream.append(reader.stamps)
        if reader.status == 200 and reader.done and not reader.errors:
            ok += 1
        elif len(errors) < 3:
            errors.append(f"HTTP {reader.status}: {b''.join(reader.body)[:200]!r}")

    c0, t0 = cpu(), mono()
    tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    t1, c1 = mono(), cpu()
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return _report(t0, t1, c0, c1, count, per_stream, ok, errors, len(pending))


def job_paced_edge(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(_paced_edge(**kwargs))


async def _paced_direct(
    node_port: int,
    script: str,
    count: int,
    offset: int,
    total: int,
    start_at: float,
    ramp_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    """This worker's share of the paced streams through the node client (trio)."""
    import trio

    from benchmarks.jobs.direct import run_request, start
    from edge.node.client import GrpcNodeClient, NodeSocket
    from edge.stream.events import Complete, Delta

    client = GrpcNodeClient("sim", NodeSocket.tcp("127.0.0.1", node_port))
    per_stream: list[list[float]] = []
    errors: list[str] = []
    ok = 0
    unfinished = 0
    c0, t0 = cpu(), mono()
    try:
        async with trio.open_nursery() as nursery:

            async def one(i: int) -> None:
                nonlocal ok
                await trio.sleep(max(0.0, start_at + ramp_s * (offset + i) / total - mono()))
                stamps: list[float] = []
                per_stream.append(stamps)
                try:
                    handle = await start(client, nursery, run_request(script))
                    events = handle.events
                    while True:
                        try:
                            kind = type(await events.receive())
                        except trio.EndOfChannel:
                            break
                        if kind is Delta:
                            stamps.append(mono())
                        elif kind is Complete:
                            ok += 1
                except Exception as exc:
                    errors.append(repr(exc)[:200])

            with trio.move_on_after(max(1.0, start_at - mono()) + timeout_s) as scope:
                async with trio.open_nursery() as streams:
                    for i in range(count):
                        streams.start_soon(one, i)
            if scope.cancelled_caught:
                unfinished = count - ok - len(errors)
            nursery.cancel_scope.cancel()
    finally:
        await client.aclose()
    t1, c1 = mono(), cpu()
    return _report(t0, t1, c0, c1, count, per_stream, ok, errors, unfinished)


def job_paced_direct(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    from benchmarks.jobs.direct import in_loop

    result: dict[str, Any] = in_loop(_paced_direct, **kwargs)
    return result


PACED_JOBS: dict[str, JobFn] = {"paced_edge": job_paced_edge, "paced_direct": job_paced_direct}
