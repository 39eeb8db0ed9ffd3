"""An upstream node run in-process, for `address = "openai+http://HOST:PORT/v1"`.

The real grpclib server of `edge.upstream.server`, listening on an ephemeral
127.0.0.1 port on the asyncio loop the bridge hosts: the edge reaches it over
gRPC like any other node, so a developer can point the edge straight at a
local model server without a second daemon. It knows nothing of the pool;
the one thing it knows of asyncio is how to let anyio (httpx) find the loop.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from edge.node.bridge import call_asyncio
from edge.upstream.server import UpstreamNode, start_server, stop_server


def _let_anyio_find_the_loop() -> None:
    """Give anyio trio-asyncio's `get_running_loop` and `current_task`.

    trio-asyncio finds its loop by replacing those functions in `asyncio`.
    anyio's asyncio backend (under httpx) imports them by name, so when it was
    imported before trio-asyncio (pytest's anyio plugin does that) it keeps
    the originals and fails with "no running event loop" on the bridge's loop
    (python-trio/trio-asyncio#83). Rebinding is idempotent; when the backend
    is not imported yet there is nothing to do, it will import the patched ones.
    """
    backend = sys.modules.get("anyio._backends._asyncio")
    if backend is not None:
        backend.get_running_loop = asyncio.get_running_loop  # type: ignore[attr-defined]
        backend.current_task = asyncio.current_task  # type: ignore[attr-defined]


@asynccontextmanager
async def embedded_upstream_node(
    name: str, upstream: str, runs_log: Path | None = None
) -> AsyncIterator[tuple[UpstreamNode, int]]:
    """Serve `upstream` as a node for the duration of the block; yields (node, port)."""
    _let_anyio_find_the_loop()
    # httpx logs every request at INFO: in the edge's log that is one line per run
    # and per Describe. The node reports what matters through its events.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    node = UpstreamNode(upstream, name=name, runs_log=runs_log)
    try:
        server, port = await call_asyncio(start_server, node, "127.0.0.1", 0)
    except BaseException:
        with trio.CancelScope(shield=True):
            await call_asyncio(node.aclose)
        raise
    try:
        yield node, port
    finally:
        with trio.CancelScope(shield=True):
            await call_asyncio(stop_server, node, server)
