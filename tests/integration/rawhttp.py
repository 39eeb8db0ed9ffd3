"""HTTP/1.1 over a raw trio stream with h11: the mock upstream servers of the tests, and
clients that send what an HTTP library would not (a body never finished)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import h11
import trio


async def read_request(
    stream: trio.SocketStream, conn: h11.Connection
) -> tuple[h11.Request, bytes] | None:
    """The next request and its whole body; None once the client closed the connection."""
    request: h11.Request | None = None
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            return request, body
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def read_response(
    stream: trio.SocketStream, conn: h11.Connection
) -> tuple[int, dict[str, str], bytes]:
    """The next response on a client's `conn`: its status, headers and whole body (to
    the end of the message, or of the connection)."""
    status, headers, body = 0, {}, bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return status, headers, bytes(body)


async def send_events(stream: trio.SocketStream, conn: h11.Connection, *events: Any) -> int:
    """Send `events` in order; returns the bytes written."""
    sent = 0
    for event in events:
        data = conn.send(event)
        if data:
            await stream.send_all(data)
            sent += len(data)
    return sent


async def send_whole(
    stream: trio.SocketStream,
    conn: h11.Connection,
    status: int,
    body: bytes,
    content_type: str = "application/json",
) -> None:
    """One whole response: `status`, `body` with its length."""
    headers = [("content-type", content_type), ("content-length", str(len(body)))]
    response = h11.Response(status_code=status, headers=headers)
    await send_events(stream, conn, response, h11.Data(body), h11.EndOfMessage())


async def serve_upstream(
    nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> str:
    """Serve `handler` on 127.0.0.1 (a port of the kernel's) in `nursery`; its
    OpenAI-style base URL (".../v1")."""
    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/v1"
