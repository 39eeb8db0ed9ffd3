"""A pass-through front for the fleet's HTTP workers that answers SMG's `GET /health`.

SMG registers an HTTP worker only once `GET /health` answers 2xx (the path is fixed in
its connection-mode probe, whatever `--health-check-endpoint` says); the edge serves
`/healthz`. Each front listens on a port of its own: on a new connection, requests
`GET /health` are answered 200 here, and from the first other request on, the
connection is piped both ways to the worker unread. Both gateways of
`benchmarks.fleetpeer` reach the workers through the same fronts, so the hop is in both
paths. One asyncio loop in a thread of the orchestrator serves every front; heads are
read up to 64 KiB, and every socket is closed when either side ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HEALTH = b"GET /health "
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
HEAD_LIMIT = 64 * 1024
START_TIMEOUT_S = 10.0


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            dst.write_eof()


async def _serve(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    port: int,
    live: set[asyncio.StreamWriter],
) -> None:
    upstream: asyncio.StreamWriter | None = None
    live.add(writer)
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            if head.startswith(HEALTH):
                writer.write(OK)
                await writer.drain()
                continue
            up_reader, upstream = await asyncio.open_connection("127.0.0.1", port)
            live.add(upstream)
            upstream.write(head)
            await asyncio.gather(_pump(reader, upstream), _pump(up_reader, writer))
            return
    except (ConnectionError, OSError):
        return
    finally:
        for w in (upstream, writer):
            if w is not None:
                live.discard(w)
                w.close()


@contextmanager
def health_fronts(ports: list[int]) -> Iterator[list[int]]:
    """A front for each worker port, for the duration of the block; yields their ports."""
    ready = threading.Event()
    bound: list[int] = []
    state: dict[str, object] = {}

    async def main() -> None:
        stop = asyncio.Event()
        state["loop"], state["stop"] = asyncio.get_running_loop(), stop
        servers = []
        live: set[asyncio.StreamWriter] = set()
        try:
            for port in ports:
                serve = functools.partial(_serve, port=port, live=live)
                server = await asyncio.start_server(serve, "127.0.0.1", 0, limit=HEAD_LIMIT)
                servers.append(server)
                bound.append(server.sockets[0].getsockname()[1])
            ready.set()
            await stop.wait()
        finally:
            ready.set()
            for server in servers:
                server.close()
            # Closing every socket ends every connection's task on its own (a task
            # cancelled by the loop's shutdown trips a bug of Python 3.11's streams).
            for w in list(live):
                w.close()
            for server in servers:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(server.wait_closed(), START_TIMEOUT_S)

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="health-fronts")
    thread.daemon = True
    thread.start()
    try:
        if not ready.wait(START_TIMEOUT_S) or len(bound) != len(ports):
            raise SystemExit("the workers' health fronts did not start")
        yield bound
    finally:
        loop, stop = state.get("loop"), state.get("stop")
        if isinstance(loop, asyncio.AbstractEventLoop) and isinstance(stop, asyncio.Event):
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        thread.join(START_TIMEOUT_S)
