"""Nodes run inside the edge: the simulated node for `address = "embedded"`, iop-node
for `address = "openai+http://HOST:PORT/v1"`.

Each is the real grpclib server of its node, reached over real gRPC like any
other, and knows nothing of the pool. It listens on a Unix socket, `node.sock`, in
a directory of its own that only the edge's user can open (mode 0700, made by
`tempfile.mkdtemp` in the edge run's directory, else the system's temporary one),
removed when the node stops: no TCP port, so no other local user runs its models
past the edge's API keys. Where the OS has no Unix sockets it listens on an
ephemeral 127.0.0.1 port instead, and says so. The sockets are named `embedded`
and `openai+URL` in errors, logs and /readyz, as their `[[nodes]]` addresses are.
They differ in the loop they run on:

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
import shutil
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from loguru import logger

from edge.node.bridge import call_asyncio
from edge.node.grpc import NodeSocket
from edge.nodes.kit import NodeServer, NodeService, start_server, stop_server
from edge.nodes.sim.kvcache import KVSettings
from edge.nodes.sim.server import SimNode
from edge.nodes.upstream.server import UpstreamNode
from edge.observe.tracing import Tracing

# Starting (binding a port) and stopping (runs close their upstream requests,
# bounded by the server's own CLOSE_TIMEOUT_S) take far less; past this the
# thread is reported stuck rather than waited on forever.
THREAD_JOIN_S = 10.0
SOCKET_NAME = "node.sock"
# A Unix socket's path is at most 107 bytes on Linux (103 on the BSDs): a run directory
# longer than this leaves too little room for the node's own directory and socket.
_LONGEST_PARENT = 64
# Whether this OS has Unix sockets (without them: a 127.0.0.1 port, with a warning).
UNIX_SOCKETS = hasattr(socket, "AF_UNIX")


@contextlib.contextmanager
def socket_directory(parent: Path | None) -> Iterator[Path | None]:
    """A new directory for one node's socket, mode 0700 (`tempfile.mkdtemp`), in `parent`
    (None, or a path too long for a socket's: the system's temporary directory); removed,
    with the socket, at the end of the block. None where the OS has no Unix sockets."""
    if not UNIX_SOCKETS:
        yield None
        return
    if parent is not None and len(str(parent)) > _LONGEST_PARENT:
        parent = None
    directory = Path(tempfile.mkdtemp(prefix="node-", dir=parent))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def _listen(
    node: NodeService, directory: Path | None, address: str
) -> tuple[NodeServer, NodeSocket]:
    """Serve `node` on its socket in `directory` (None: on a 127.0.0.1 port); on the
    asyncio loop the node runs on."""
    if directory is None:
        server, port = await start_server(node, "127.0.0.1", 0)
        logger.warning(
            "node {} listens on 127.0.0.1:{}: this OS has no Unix sockets, so any local"
            " user reaches it",
            node.name, port,
        )  # fmt: skip
        return server, NodeSocket(address, host="127.0.0.1", port=port)
    path = str(directory / SOCKET_NAME)
    server = NodeServer([node])
    await server.listen_unix(path)
    return server, NodeSocket.unix(path, address)


@asynccontextmanager
async def embedded_node(
    name: str,
    runs_log: Path | None = None,
    *,
    tracing: Tracing | None = None,
    kv: KVSettings | None = None,
    run_dir: Path | None = None,
) -> AsyncIterator[tuple[SimNode, NodeSocket]]:
    """Serve a simulated node for the duration of the block; yields the node and where
    it listens (its socket in a new directory in `run_dir`, see the module doc).
    With `tracing`, its runs' spans go out with the edge's; `kv`: its KV cache model
    (off by default)."""
    node = SimNode(name=name, runs_log=runs_log, tracing=tracing, kv=kv)
    with socket_directory(run_dir) as directory:
        server, where = await call_asyncio(_listen, node, directory, "embedded")
        try:
            yield node, where
        finally:
            with trio.CancelScope(shield=True):
                await call_asyncio(stop_server, node, server)


class _NodeThread:
    """One node on its own asyncio loop in a thread.

    `start` waits until it listens, `stop` until its thread ended.
    """

    def __init__(self, node: UpstreamNode, directory: Path | None, address: str) -> None:
        self.node = node
        self.directory = directory
        self.address = address
        self.where: NodeSocket | None = None
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
            server, self.where = await _listen(self.node, self.directory, self.address)
        except BaseException:
            await self.node.aclose()
            raise
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await stop_server(self.node, server)

    def start(self) -> NodeSocket:
        """Run the node; blocks until it listens (returns where) or failed (raises)."""
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join(THREAD_JOIN_S)
            raise self._error
        assert self.where is not None
        return self.where

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
    name: str,
    upstream: str,
    runs_log: Path | None = None,
    *,
    tracing: Tracing | None = None,
    run_dir: Path | None = None,
) -> AsyncIterator[tuple[UpstreamNode, NodeSocket]]:
    """Serve `upstream` as a node for the duration of the block; yields the node and
    where it listens (its socket in a new directory in `run_dir`, see the module doc).
    With `tracing`, its runs' spans go out with the edge's."""
    # httpx logs every request at INFO: in the edge's log that is one line per run
    # and per Describe. The node reports what matters through its events.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    node = UpstreamNode(upstream, name=name, runs_log=runs_log, tracing=tracing)
    with socket_directory(run_dir) as directory:
        host = _NodeThread(node, directory, f"openai+{upstream}")
        where = await trio.to_thread.run_sync(host.start, abandon_on_cancel=False)
        try:
            yield host.node, where
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(host.stop)
