"""Trio jobs: the node through the edge's own node client, beside the edge over HTTP.

The baseline of most figures is "the same run via the node client directly":
`edge.node.client.GrpcNodeClient` over the trio-asyncio bridge (`edge.node.bridge`),
in a load-generator process, against the same simulated node. The jobs that compare
(time to first token, disconnect -> CancelRun) interleave the edge over raw HTTP
(`benchmarks.httpclient.TrioConnection`) and the node client in one process and one
trio loop, sample by sample, so both see the same machine at the same moment.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio_asyncio  # noqa: F401  (before grpclib, which the contract's code imports: edge.node)

from benchmarks.httpclient import ResponseReader, TrioConnection
from benchmarks.jobs.base import Ctl, JobFn, max_backlog
from edge.contract._proto.iop.node import v1 as pb
from edge.node.bridge import asyncio_loop
from edge.node.client import GrpcNodeClient, NodeSocket, RunHandle
from edge.stream.events import Complete, Delta

mono = time.monotonic
perf = time.perf_counter
cpu = time.process_time
RUN_DEADLINE_S = 600.0


def run_request(script: str) -> pb.RunRequest:
    return pb.RunRequest(
        run_id=secrets.token_hex(12),
        model="sim-script",
        messages=[pb.Message(role="user", content=script)],
    )


async def start(client: GrpcNodeClient, nursery: trio.Nursery, request: pb.RunRequest) -> RunHandle:
    return await client.start_run(nursery, request, deadline=trio.current_time() + RUN_DEADLINE_S)


async def _count(handle: RunHandle, t0: float) -> tuple[int, float | None, bool]:
    """Read a run to its end: (content events, seconds to the first, completed)."""
    first: float | None = None
    n = 0
    complete = False
    receive = handle.events.receive
    receive_nowait = handle.events.receive_nowait
    while True:
        try:
            event = await receive()
        except trio.EndOfChannel:
            return n, first, complete
        if first is None and type(event) is Delta:
            first = perf() - t0
        # Take what is already here without a checkpoint each (the edge batches alike).
        while True:
            kind = type(event)
            if kind is Delta:
                n += 1
            elif kind is Complete:
                complete = True
            try:
                event = receive_nowait()
            except trio.WouldBlock:
                break
            except trio.EndOfChannel:
                return n, first, complete


async def _sleep_until(when: float) -> None:
    await trio.sleep(max(0.0, when - mono()))


def in_loop(fn: Callable[..., Awaitable[Any]], **kwargs: Any) -> Any:
    async def main() -> Any:
        async with asyncio_loop():
            return await fn(**kwargs)

    return trio.run(main)


# --- time to first token, interleaved -------------------------------------------------


async def _ttft(
    host: str,
    port: int,
    node_port: int,
    edge_request: bytes,
    script: str,
    samples: int,
    warmup: int,
    timeout_s: float,
) -> dict[str, Any]:
    client = GrpcNodeClient("sim", NodeSocket.tcp("127.0.0.1", node_port))
    conn = await TrioConnection.open(host, port)
    edge_ms: list[float] = []
    direct_ms: list[float] = []
    try:
        async with trio.open_nursery() as nursery:

            async def via_edge() -> float:
                reader = ResponseReader()
                t0 = perf()
                await conn.request(edge_request, reader)
                if reader.status != 200 or reader.first_content_at is None:
                    raise RuntimeError(f"edge answered {reader.status} without content")
                return (reader.first_content_at - t0) * 1e3

            async def direct() -> float:
                request = run_request(script)
                t0 = perf()
                handle = await start(client, nursery, request)
                _, first, _ = await _count(handle, t0)
                if first is None:
                    raise RuntimeError("the node sent no content")
                return first * 1e3

            with trio.move_on_after(timeout_s):
                for i in range(warmup + samples):
                    if i % 2 == 0:
                        e, d = await via_edge(), await direct()
                    else:
                        d, e = await direct(), await via_edge()
                    if i >= warmup:
                        edge_ms.append(e)
                        direct_ms.append(d)
    finally:
        await conn.aclose()
        await client.aclose()
    return {"edge_ms": edge_ms, "direct_ms": direct_ms}


def job_ttft(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    result: dict[str, Any] = in_loop(_ttft, **kwargs)
    return result


# --- streams through the node client --------------------------------------------------


async def _direct_streams(
    node_port: int, script: str, count: int, start_at: float, timeout_s: float
) -> dict[str, Any]:
    client = GrpcNodeClient("sim", NodeSocket.tcp("127.0.0.1", node_port))
    chunks = 0
    ok = 0
    errors: list[str] = []
    ttfts: list[float] = []
    await _sleep_until(start_at)
    c0, t0 = cpu(), mono()
    try:
        async with trio.open_nursery() as nursery:

            async def one() -> None:
                nonlocal chunks, ok
                try:
                    started = perf()
                    handle = await start(client, nursery, run_request(script))
                    n, first, complete = await _count(handle, started)
                except Exception as exc:
                    errors.append(repr(exc)[:200])
                    return
                chunks += n
                ok += complete
                if first is not None:
                    ttfts.append(first * 1e3)

            with trio.move_on_after(timeout_s):
                async with trio.open_nursery() as streams:
                    for _ in range(count):
                        streams.start_soon(one)
            nursery.cancel_scope.cancel()
    finally:
        await client.aclose()
    t1, c1 = mono(), cpu()
    ttfts.sort()
    return {
        "t_start": t0,
        "t_end": t1,
        "cpu_s": c1 - c0,
        "streams": count,
        "ok": ok,
        "incomplete": count - ok - len(errors),
        "errors": len(errors),
        "unfinished": 0,
        "chunks": chunks,
        "http_chunks": 0,
        "ttft_p50_ms": ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
        if ttfts
        else None,
        "first_error": errors[0] if errors else None,
    }


def job_direct_streams(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    result: dict[str, Any] = in_loop(_direct_streams, **kwargs)
    return result


async def _direct_rate(
    node_port: int, script: str, rate: float, seconds: float, start_at: float, timeout_s: float
) -> dict[str, Any]:
    """Open loop through the node client: run i is due at start + i/rate."""
    client = GrpcNodeClient("sim", NodeSocket.tcp("127.0.0.1", node_port))
    latencies: list[float] = []
    errors: list[str] = []
    n = int(rate * seconds)
    backlog = max_backlog(rate)
    started = 0
    stopped_at: float | None = None
    await _sleep_until(start_at)
    c0, t0 = cpu(), mono()
    try:
        async with trio.open_nursery() as nursery:

            async def one(due: float) -> None:
                try:
                    handle = await start(client, nursery, run_request(script))
                    _, _, complete = await _count(handle, perf())
                except Exception as exc:
                    errors.append(repr(exc)[:200])
                    return
                if complete:
                    latencies.append((mono() - due) * 1e3)
                else:
                    errors.append("run ended without complete")

            with trio.move_on_after(seconds + timeout_s):
                async with trio.open_nursery() as runs:
                    for i in range(n):
                        due = t0 + i / rate
                        await _sleep_until(due)
                        if started - len(latencies) - len(errors) > backlog:
                            stopped_at = mono() - t0
                            break
                        runs.start_soon(one, due)
                        started += 1
            nursery.cancel_scope.cancel()
    finally:
        await client.aclose()
    t1, c1 = mono(), cpu()
    return {
        "t_start": t0,
        "t_end": t1,
        "cpu_s": c1 - c0,
        "requests": n,
        "latencies_ms": latencies,
        "errors": len(errors),
        "unfinished": n - len(latencies) - len(errors),
        "connections": None,
        "stopped_at_s": stopped_at,
        "first_error": errors[0] if errors else None,
    }


def job_direct_rate(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    result: dict[str, Any] = in_loop(_direct_rate, **kwargs)
    return result


# --- disconnect -> CancelRun, interleaved ---------------------------------------------


async def _disconnects(
    host: str,
    port: int,
    node_port: int,
    edge_request: bytes,
    script: str,
    samples: int,
    pause_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    """Open a stream, read its first content, go away; note when, per run id.

    The orchestrator matches each run id with the time its line reached the node's
    runs log (written when CancelRun arrives).
    """
    client = GrpcNodeClient("sim", NodeSocket.tcp("127.0.0.1", node_port))
    edge: list[tuple[str, float]] = []
    direct: list[tuple[str, float]] = []
    try:
        async with trio.open_nursery() as nursery:

            async def via_edge() -> None:
                conn = await TrioConnection.open(host, port)
                reader = ResponseReader(stop_after=1)
                await conn.request(edge_request, reader)
                t = mono()
                await conn.aclose()
                if reader.run_id is not None:
                    edge.append((reader.run_id, t))

            async def via_client() -> None:
                request = run_request(script)
                handle = await start(client, nursery, request)
                events = handle.events
                with contextlib.suppress(trio.EndOfChannel):  # the run ended without a delta
                    while type(await events.receive()) is not Delta:
                        pass
                t = mono()
                handle.cancel("client_disconnected")
                direct.append((request.run_id, t))

            with trio.move_on_after(timeout_s):
                for i in range(samples):
                    for fn in (via_edge, via_client) if i % 2 == 0 else (via_client, via_edge):
                        await fn()
                        await trio.sleep(pause_s)
            with trio.move_on_after(5.0):
                await trio.sleep(pause_s)
            nursery.cancel_scope.cancel()
    finally:
        await client.aclose()
    return {"edge": edge, "direct": direct}


def job_disconnects(ctl: Ctl, **kwargs: Any) -> dict[str, Any]:
    result: dict[str, Any] = in_loop(_disconnects, **kwargs)
    return result


DIRECT_JOBS: dict[str, JobFn] = {
    "ttft": job_ttft,
    "direct_streams": job_direct_streams,
    "direct_rate": job_direct_rate,
    "disconnects": job_disconnects,
}
