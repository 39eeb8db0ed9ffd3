"""A trivially fast SSE server, to measure the load generator alone.

It answers every POST with the same pre-rendered stream: the edge's own frames (built
with `edge.api.render.SSEEncoder`), one SSE frame per HTTP chunk, as many chunks per
socket write as fit in 64 KiB. Whatever rate the client reaches against it is the
ceiling of the client, not of any server. Run: `python -m benchmarks.replay N` (N
content frames per response); it prints `replay listening on 127.0.0.1:PORT`.
"""

from __future__ import annotations

import asyncio
import sys
from typing import ClassVar

from edge.api.render import SSEEncoder
from edge.stream.output import ContentOut, FinishOut, OutEvent, RoleOut

HEAD = (
    b"HTTP/1.1 200 \r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)


def render(frames: int) -> list[bytes]:
    """The response as socket writes of about 64 KiB, one SSE frame per HTTP chunk."""
    encoder = SSEEncoder(
        "chatcmpl-replay0123456789abcdef", 1_700_000_000, "sim-script", include_usage=False
    )
    events: list[OutEvent] = [RoleOut(), *(ContentOut("tok") for _ in range(frames))]
    events.append(FinishOut("stop", None))
    writes: list[bytes] = [HEAD]
    current: list[bytes] = []
    size = 0
    for event in events:
        frame = encoder.encode([event])
        chunk = b"%x\r\n%s\r\n" % (len(frame), frame)
        current.append(chunk)
        size += len(chunk)
        if size >= 1 << 16:
            writes.append(b"".join(current))
            current, size = [], 0
    current.append(b"0\r\n\r\n")
    writes.append(b"".join(current))
    return writes


class _Conn(asyncio.Protocol):
    writes: ClassVar[list[bytes]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buf = b""
        self.task: asyncio.Task[None] | None = None
        self.can_write = asyncio.Event()
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        if self.task is not None:
            return
        i = self.buf.find(b"\r\n\r\n")
        if i < 0:
            return
        head = self.buf[:i].lower()
        length = 0
        for line in head.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        if len(self.buf) < i + 4 + length:
            return
        self.buf = self.buf[i + 4 + length :]
        self.task = asyncio.ensure_future(self._answer())

    async def _answer(self) -> None:
        for data in self.writes:
            if self.transport.is_closing():
                return
            self.transport.write(data)
            await self.can_write.wait()
            await asyncio.sleep(0)
        self.task = None
        self._next()

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.can_write.set()
        if self.task is not None:
            self.task.cancel()


async def serve(frames: int) -> None:
    _Conn.writes = render(frames)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Conn, "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    print(f"replay listening on 127.0.0.1:{port}", flush=True)
    await server.serve_forever()


def main() -> None:
    asyncio.run(serve(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000))


if __name__ == "__main__":
    main()
