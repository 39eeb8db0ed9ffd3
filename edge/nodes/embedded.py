"""Nodes run inside the edge: the simulated node for `address = "embedded"`, iop-node
for `address = "openai+http://HOST:PORT/v1"`.

Each is the real grpclib server of its node, listening on an ephemeral
127.0.0.1 port, so an embedded node is reached over real gRPC like any
other, and knows nothing of the pool. They differ in the loop they run on:

- `embedded_node`: the simulated node, on the asyncio loop the bridge hosts
  inside trio (`edge.node.bridge`).
- `embedded_upstream_node`: iop-node, on an asyncio loop of its own in a
  thread (a `SelectorEventLoop`, named as the runner's loop factory: the
  policy trio-asyncio installs would make it trio-asyncio's), not on the
  trio-asyncio loop: httpx's transport (anyio) finds the running loop the
  standard way there, so nothing of anyio or asyncio is patched. A
  developer can point the edge straight at a local model server without a
  second daemon. The edge's client of such a node relays its runs itself
  (`edge.nodes.direct`): this node answers its Describe and Watch, and
  serves a Run only when something else calls it over gRPC. Stopping it
  stops the server and any runs on that loop, then joins the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from edge.node.bridge import call_asyncio
from edge.nodes.kit import start_server, stop_server
from edge.nodes.sim.kvcache import KVSettings
from edge.nodes.sim.server import SimNode
from edge.nodes.upstream.server import UpstreamNode
from edge.observe.tracing import Tracing

# Starting (binding a port) and stopping (runs close their upstream requests,
# bounded by the server's own CLOSE_TIMEOUT_S) take far less; past this the
# thread is reported stuck rather than waited on forever.
THREAD_JOIN_S = 10.0


@asynccontextmanager
async def embedded_node(
    name: str,
    runs_log: Path | None = None,
    *,
    tracing: Tracing | None = None,
    kv: KVSettings | None = None,
) -> AsyncIterator[tuple[SimNode, int]]:
    """Serve a simulated node for the duration of the block; yields (node, port).
    With `tracing`, its runs' spans go out with the edge's; `kv`: its KV cache model
    (off by default)."""
    node = SimNode(name=name, runs_log=runs_log, tracing=tracing, kv=kv)
    server, port = await call_asyncio(start_server, node, "127.0.0.1", 0)
    try:
        yield node, port
    finally:
        with trio.CancelScope(shield=True):
            await call_asyncio(stop_server, node, server)


class _NodeThread:
    """One node on its own asyncio loop in a thread.

    `start` waits until it listens, `stop` until its thread ended.
    """

    def __init__(self, node: UpstreamNode) -> None:
        self.node = node
        self.port = 0
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name=f"node {node.name}", daemon=True)

    def _main(self) -> None:
        try:
            # A loop of asyncio's own, named: trio-asyncio's event loop policy (the
            # edge's bridge installs it) would give `asyncio.run` a SyncTrioEventLoop,
            # a trio run under asyncio, which costs the node several times the CPU.
            with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
                runner.run(self._serve())
        except BaseException as exc:  # reported to whoever waits on start()
            self._error = exc
        finally:
            self._started.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            server, self.port = await start_server(self.node, "127.0.0.1", 0)
        except BaseException:
            await self.node.aclose()
            raise
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await stop_server(self.node, server)

    def start(self) -> int:
        """Run the node; blocks until it listens (returns its port) or failed (raises)."""
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join(THREAD_JOIN_S)
            raise self._error
        return self.port

    def stop(self) -> None:
        """Stop serving and wait for the thread (blocking)."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed already
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(THREAD_JOIN_S)
        if self._thread.is_alive():
            raise RuntimeError(f"embedded node {self.node.name} did not stop")
        if self._error is not None:
            raise self._error


@asynccontextmanager
async def embedded_upstream_node(
    name: str, upstream: str, runs_log: Path | None = None, *, tracing: Tracing | None = None
) -> AsyncIterator[tuple[UpstreamNode, int]]:
    """Serve `upstream` as a node for the duration of the block; yields (node, port).
    With `tracing`, its runs' spans go out with the edge's."""
    # httpx logs every request at INFO: in the edge's log that is one line per run
    # and per Describe. The node reports what matters through its events.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    host = _NodeThread(UpstreamNode(upstream, name=name, runs_log=runs_log, tracing=tracing))
    port = await trio.to_thread.run_sync(host.start, abandon_on_cancel=False)
    try:
        yield host.node, port
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(host.stop)
