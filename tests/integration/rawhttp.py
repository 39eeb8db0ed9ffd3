"""HTTP/1.1 over a raw trio stream with h11, for the mock upstream servers of the tests."""

from __future__ import annotations

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


async def send_events(stream: trio.SocketStream, conn: h11.Connection, *events: Any) -> int:
    """Send `events` in order; returns the bytes written."""
    sent = 0
    for event in events:
        data = conn.send(event)
        if data:
            await stream.send_all(data)
            sent += len(data)
    return sent
