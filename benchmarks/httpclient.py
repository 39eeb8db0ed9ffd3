"""A minimal HTTP/1.1 client for the load generator: keep-alive, chunked bodies, SSE counting.

Only what the benchmarks need, cheap per byte so the client is never the bottleneck:

- `ResponseReader` is sans-IO: bytes in, counts out. It parses the status line and
  headers, de-chunks a chunked body (or takes a Content-Length body) and, for an SSE
  body, counts content frames by a byte pattern (no JSON parsing), notes the time of the
  first content frame (for paced streams: of every one), the run id (from
  `"id":"chatcmpl-<run_id>"`), error frames and `data: [DONE]`, and (`keep_usage`) keeps
  the final usage frame's JSON.
- `AioConnection` drives it on asyncio (an `asyncio.Protocol`, no StreamReader).
- `TrioConnection` drives it on trio, for the in-process comparison with the node client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import trio

CONTENT_MARK = b'"delta":{"content":'
ERROR_MARK = b'data: {"error":'
DONE_MARK = b"data: [DONE]"
ID_MARK = b'"id":"chatcmpl-'
USAGE_MARK = b'"usage":{'

_HEAD, _LENGTH, _SIZE, _DATA, _CRLF, _TRAILER, _DONE = range(7)

perf = time.perf_counter


def build_post(
    host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None
) -> bytes:
    """The bytes of one keep-alive JSON POST."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + body


class ResponseReader:
    """One HTTP/1.1 response, fed bytes as they arrive.

    `feed` returns True once the reader wants no more bytes: the response is complete
    (`complete`), or `stop_after` content frames were seen (the caller then keeps or
    closes the connection; it cannot be reused).
    """

    __slots__ = (
        "_buf",
        "_carry",
        "_chunk_left",
        "_keep_body",
        "_keep_usage",
        "_state",
        "body",
        "close",
        "complete",
        "content",
        "done",
        "errors",
        "first_content_at",
        "http_chunks",
        "retry_after",
        "run_id",
        "stamps",
        "status",
        "stop_after",
        "stopped",
        "usage",
    )

    def __init__(
        self,
        *,
        keep_body: bool = False,
        stop_after: int = 0,
        stamps: bool = False,
        keep_usage: bool = False,
    ) -> None:
        self._buf = b""
        self._carry = b""
        self._chunk_left = 0
        self._keep_body = keep_body
        self._keep_usage = keep_usage
        self._state = _HEAD
        self.body: list[bytes] = []
        self.close = False
        self.complete = False
        self.content = 0
        self.done = False
        self.errors = 0
        self.first_content_at: float | None = None
        self.http_chunks = 0
        self.retry_after: bytes | None = None  # the Retry-After header's value, if any
        self.run_id: str | None = None
        # The monotonic arrival time of every content frame (paced streams only): frames
        # that arrive in one read share a time, as a batched write delivers them.
        self.stamps: list[float] | None = [] if stamps else None
        self.status = 0
        self.stop_after = stop_after
        self.stopped = False
        # With keep_usage: the JSON of the last frame whose usage is an object (OpenAI's
        # final chunk under `stream_options.include_usage`), the only frame parsed.
        self.usage: bytes | None = None

    def feed(self, data: bytes) -> bool:
        buf = self._buf + data if self._buf else data
        pos = 0
        end = len(buf)
        state = self._state
        while pos < end:
            if state == _DATA:
                n = min(self._chunk_left, end - pos)
                self._payload(buf[pos : pos + n] if n < end - pos or pos else buf)
                pos += n
                self._chunk_left -= n
                if self._chunk_left == 0:
                    state = _CRLF
            elif state == _SIZE:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                size = int(buf[pos:i].split(b";", 1)[0], 16)
                pos = i + 2
                if size == 0:
                    state = _TRAILER
                else:
                    self._chunk_left = size
                    self.http_chunks += 1
                    state = _DATA
            elif state == _CRLF:
                if end - pos < 2:
                    break
                pos += 2
                state = _SIZE
            elif state == _LENGTH:
                n = min(self._chunk_left, end - pos)
                self._payload(buf[pos : pos + n] if n < end - pos or pos else buf)
                pos += n
                self._chunk_left -= n
                if self._chunk_left == 0:
                    state = _DONE
            elif state == _HEAD:
                i = buf.find(b"\r\n\r\n", pos)
                if i < 0:
                    break
                state = self._head(buf[pos:i])
                pos = i + 4
            elif state == _TRAILER:
                if buf.startswith(b"\r\n", pos):
                    pos += 2
                    state = _DONE
                else:
                    i = buf.find(b"\r\n\r\n", pos)
                    if i < 0:
                        break
                    pos = i + 4
                    state = _DONE
            if state == _DONE or self.stopped:
                break
        self._state = state
        self._buf = buf[pos:] if pos < end else b""
        if state == _DONE:
            self.complete = True
            if self._carry:
                self._frames(self._carry)
                self._carry = b""
            return True
        return self.stopped

    def _head(self, head: bytes) -> int:
        lines = head.split(b"\r\n")
        self.status = int(lines[0].split(b" ", 2)[1])
        length = -1
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                self.close = b"close" in value.lower()
            elif name == b"retry-after":
                self.retry_after = value.strip()
        if chunked:
            return _SIZE
        if length > 0:
            self._chunk_left = length
            return _LENGTH
        return _DONE

    def _payload(self, payload: bytes) -> None:
        if self._keep_body or self.status != 200:
            self.body.append(payload)
            return
        if self._carry:
            payload = self._carry + payload
            self._carry = b""
        cut = payload.rfind(b"\n\n")
        if cut < 0:
            self._carry = payload
            return
        cut += 2
        if cut < len(payload):
            self._carry = payload[cut:]
            payload = payload[:cut]
        self._frames(payload)

    def _frames(self, frames: bytes) -> None:
        n = frames.count(CONTENT_MARK)
        if n:
            if self.first_content_at is None:
                self.first_content_at = perf()
            self.content += n
            if self.stamps is not None:
                self.stamps.extend([time.monotonic()] * n)
            if self.stop_after and self.content >= self.stop_after:
                self.stopped = True
        if self.run_id is None:
            i = frames.find(ID_MARK)
            if i >= 0:
                i += len(ID_MARK)
                self.run_id = frames[i : frames.index(b'"', i)].decode()
        if ERROR_MARK in frames:
            self.errors += frames.count(ERROR_MARK)
        if DONE_MARK in frames:
            self.done = True
        if self._keep_usage:
            i = frames.rfind(USAGE_MARK)
            if i >= 0:
                start = frames.rfind(b"data: ", 0, i) + len(b"data: ")
                end = frames.find(b"\n", i)
                self.usage = frames[start : end if end >= 0 else len(frames)]

    def text(self) -> bytes:
        return b"".join(self.body)


class AioConnection(asyncio.Protocol):
    """One keep-alive connection on asyncio; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._reader: ResponseReader | None = None
        self._waiter: asyncio.Future[ResponseReader] | None = None
        self.lost = False

    @classmethod
    async def open(cls, host: str, port: int) -> AioConnection:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(cls, host, port)
        return protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        if reader is not None and reader.feed(data):
            self._reader = None
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(reader)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    def request(self, data: bytes, reader: ResponseReader) -> asyncio.Future[ResponseReader]:
        """Send one request; the future resolves when `reader` wants no more bytes."""
        assert self.transport is not None
        if self.lost:
            raise ConnectionError("connection lost")
        self._reader = reader
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self._waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    @property
    def reusable(self) -> bool:
        return not self.lost and self._reader is None


class TrioConnection:
    """One keep-alive connection on trio; one request at a time."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream

    @classmethod
    async def open(cls, host: str, port: int) -> TrioConnection:
        return cls(await trio.open_tcp_stream(host, port))

    async def request(
        self, data: bytes, reader: ResponseReader, sent: Callable[[], None] | None = None
    ) -> ResponseReader:
        await self.stream.send_all(data)
        if sent is not None:
            sent()
        receive = self.stream.receive_some
        while True:
            chunk = await receive(65536)
            if not chunk:
                raise ConnectionError("connection closed by the server")
            if reader.feed(chunk):
                return reader

    async def aclose(self) -> None:
        await self.stream.aclose()
