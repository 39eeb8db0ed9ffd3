"""A simulated node run in-process, for `address = "embedded"`.

It is the real grpclib server of `edge.nodes.sim`, listening on an ephemeral
127.0.0.1 port on the asyncio loop the bridge hosts, so an embedded node is
reached over real gRPC like any other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from edge.node.bridge import call_asyncio
from edge.nodes.kit import start_server, stop_server
from edge.nodes.sim.server import SimNode
from edge.observe.tracing import Tracing


@asynccontextmanager
async def embedded_node(
    name: str, runs_log: Path | None = None, *, tracing: Tracing | None = None
) -> AsyncIterator[tuple[SimNode, int]]:
    """Serve a simulated node for the duration of the block; yields (node, port).
    With `tracing`, its runs' spans go out with the edge's."""
    node = SimNode(name=name, runs_log=runs_log, tracing=tracing)
    server, port = await call_asyncio(start_server, node, "127.0.0.1", 0)
    try:
        yield node, port
    finally:
        with trio.CancelScope(shield=True):
            await call_asyncio(stop_server, node, server)
