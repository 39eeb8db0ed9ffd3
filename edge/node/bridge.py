"""The one place where trio and asyncio meet.

grpclib is asyncio-only. The edge runs on trio, with an asyncio loop hosted
inside it by trio-asyncio. This module opens that loop, runs asyncio
coroutines from trio, and adapts a trio memory channel into the `EventSink`
the asyncio read loop writes to. Nothing else in the edge imports
trio_asyncio; nothing outside `edge.node` (and the simulated node) imports
asyncio.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import ParamSpec, TypeVar

import trio
import trio_asyncio

from edge.node.grpc import Accepted
from edge.stream.events import NodeEvent

P = ParamSpec("P")
T = TypeVar("T")

Item = NodeEvent | Accepted


@asynccontextmanager
async def asyncio_loop() -> AsyncIterator[None]:
    """Host an asyncio loop inside the current trio run for grpclib."""
    async with trio_asyncio.open_loop():
        yield


async def call_asyncio(fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Await the asyncio coroutine `fn(*args)` from trio; trio cancellation cancels it."""
    result: T = await trio_asyncio.aio_as_trio(fn)(*args, **kwargs)
    return result


class TrioSink:
    """An EventSink over a trio memory channel: no hop while the channel has room."""

    __slots__ = ("_limit_s", "_put", "_send", "_send_nowait")

    def __init__(self, send: trio.MemorySendChannel[Item], *, limit_s: float = math.inf) -> None:
        self._send = send
        self._send_nowait = send.send_nowait
        self._limit_s = limit_s
        self._put: Callable[[Item], Awaitable[None]] = trio_asyncio.trio_as_aio(self._bounded_send)

    async def _bounded_send(self, item: Item) -> None:
        # Raises trio.TooSlowError when the reader has taken nothing for limit_s.
        with trio.fail_after(self._limit_s):
            await self._send.send(item)

    def put_nowait(self, item: Item) -> bool:
        try:
            self._send_nowait(item)
        except trio.WouldBlock:
            return False
        return True

    def put(self, item: Item) -> Awaitable[None]:
        """Wait for room (backpressure reaches the node through HTTP/2 flow control).

        Waiting longer than `limit_s` raises trio.TooSlowError: the consumer
        is stuck (a client that stopped reading).
        """
        return self._put(item)
