"""Checks h11 does not make on request heads, done before hypercorn sees them.

The request-head checks of one connection, as a pure state machine.

Everything here is about bytes a client sent; no I/O, no trio (the time is
passed in). The serving loop feeds each received chunk to `HeadScanner.feed`
and hands what comes back to hypercorn. On HTTP/1.1 the scanner follows the
request framing (heads, Content-Length bodies, chunked bodies) only to know
where each head starts: it looks at heads and never at a body's bytes. On
HTTP/2 it reads frame headers only (`H2FrameWatch`). Work is linear in the
bytes fed, and a head is buffered up to `max_head_bytes` at most.

h11 0.16 accepts a request carrying both Content-Length and
Transfer-Encoding, and unfolds obsolete line folding; RFC 9112 (6.1, 5.2)
asks a server to reject both. It also lets hypercorn switch protocols on an
`Upgrade` header (h2c, WebSocket), the path by which several one-packet
crashes of hypercorn 0.18.0 are reached. The edge serves neither upgrade, so
the `Upgrade` header line is dropped from the head: the request is answered
as the plain HTTP/1.1 request it also is (RFC 9110 7.8 lets a server ignore
Upgrade). Bytes the scanner cannot frame (a malformed chunk header, a bad
Content-Length) are passed through untouched: h11 rejects them and closes
the connection, so no later head goes unchecked.

On HTTP/2 (prior knowledge; h2c upgrades are dropped above), h2 4.4 already
refuses more than 64 CONTINUATION frames and decodes a header block against
MAX_HEADER_LIST_SIZE, but only once the whole block has arrived, and nothing
in h2 or hypercorn limits how fast a client resets the streams it opens (the
"rapid reset" attack, CVE-2023-44487: each new stream starts a handler, each
reset cancels it, and concurrency limits never apply). `H2FrameWatch` reads
the 9-byte header of every frame the client sends and refuses a header block
larger than the header list limit as it arrives, and RST_STREAM frames past
a token bucket (a burst, then a steady rate per second, per connection). A
DATA or HEADERS frame on a stream the client already ended counts as a reset
too: h2 answers it by resetting the stream, which frees a concurrent-stream
slot while the handler goes on ("MadeYouReset", CVE-2025-8671).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

# The end of a head, as h11 finds it: a blank line, CRLF or bare LF.
_BLANK_LINE = re.compile(rb"\n\r?\n")
_CHUNK_SIZE = re.compile(rb"[ \t]*([0-9A-Fa-f]{1,20})[ \t]*(?:;[^\r\n]*)?\r?\n")
_H2_PREFACE_LINE = b"PRI * HTTP/2.0"
# What follows the preface's first "head" (h2 itself checks these bytes).
_H2_PREFACE_REST = len(b"SM\r\n\r\n")
_FRAME_HEADER = 9
_DATA, _HEADERS, _RST_STREAM, _CONTINUATION = 0x0, 0x1, 0x3, 0x9
_END_STREAM, _END_HEADERS = 0x1, 0x4
# Streams remembered as ended by the client (the oldest forgotten first).
_ENDED_KEPT = 256


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a head is refused: the status and message of the error answer."""

    status: int
    message: str
    code: str
    kind: str = "bad_request"  # the connection error it is counted as


# The server's HTTP/2 limits (set on hypercorn's Config by `edge.http.server`; the
# header list size and the resets are watched per frame here, see `H2Limits`).
# Streams one connection may have open at once (a request each; nginx allows 128).
H2_MAX_CONCURRENT_STREAMS = 100
# Header list size (RFC 9113 SETTINGS_MAX_HEADER_LIST_SIZE), also the cap on the
# bytes of one header block as sent.
H2_MAX_HEADER_LIST_SIZE = 2**16
# The largest frame a client may send (the protocol's minimum, 16 KiB).
H2_MAX_INBOUND_FRAME_SIZE = 2**14
# Stream resets a client may send: a burst (twice the concurrent streams, so a
# client may cancel all it has open), then this many per second.
H2_RESET_BURST = 2 * H2_MAX_CONCURRENT_STREAMS
H2_RESETS_PER_S = 100.0


@dataclass(frozen=True, slots=True)
class H2Limits:
    """What one HTTP/2 connection may send (see `H2FrameWatch`)."""

    max_header_block: int  # bytes of one HEADERS + CONTINUATION block, as sent
    reset_burst: int  # RST_STREAM frames allowed at once
    resets_per_s: float  # and then this many per second


class H2FrameWatch:
    """Follows the frames a client sends on HTTP/2 by their headers; never reads a payload.

    A header block is counted as its encoded bytes: HPACK never makes a
    sane encoding larger than the header list it carries (each field counts
    32 bytes more in the list size), so a block past `max_header_block` is
    refused before it is all buffered.
    """

    __slots__ = (
        "_block", "_ended", "_header", "_last_time", "_left", "_limits", "_tokens",
        "last_stream_id",
    )  # fmt: skip

    def __init__(self, limits: H2Limits) -> None:
        self._limits = limits
        self._left = _H2_PREFACE_REST  # bytes to pass before the next frame header
        self._header = bytearray()
        self._block = -1  # bytes of the header block in progress; -1 when none
        self._tokens = float(limits.reset_burst)
        self._last_time: float | None = None
        self.last_stream_id = 0  # the highest stream the client opened
        self._ended: dict[int, None] = {}  # streams the client ended, oldest first

    def feed(self, data: bytes, start: int, now: float) -> tuple[bytes, Rejection | None]:
        """Read `data[start:]`; returns the bytes to hand on now, and a rejection that
        ends the connection (the frame it names is not handed on).

        A frame header split between two receives is held back until it is
        whole (9 bytes at most), so a refused frame is never handed on in part.
        """
        out: list[bytes] = []
        pos = run = start  # `data[run:pos]` passes through as it is
        end = len(data)
        while pos < end:
            if self._left:
                take = min(self._left, end - pos)
                pos += take
                self._left -= take
                continue
            held = len(self._header)
            take = min(_FRAME_HEADER - held, end - pos)
            self._header += data[pos : pos + take]
            if len(self._header) < _FRAME_HEADER:
                end = pos  # the rest of this header comes with the next receive
                break
            header = bytes(self._header)
            self._header.clear()
            rejection = self._frame(header, now)
            if rejection is not None:
                out.append(data[run:pos])
                return b"".join(out), rejection
            if held:  # the start of this header was held back: hand it all on now
                out += (data[run:pos], header)
                run = pos + take
            pos += take
        out.append(data[run:end])
        return b"".join(out), None

    def _frame(self, header: bytes, now: float) -> Rejection | None:
        length = int.from_bytes(header[:3], "big")
        kind, flags = header[3], header[4]
        stream_id = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
        self._left = length
        if kind in (_DATA, _HEADERS) and stream_id in self._ended:
            # A frame on a stream the client ended: h2 resets the stream while its
            # handler runs on, out of the concurrent-stream count ("MadeYouReset",
            # CVE-2025-8671). It costs what a reset costs: it counts as one.
            rejection = self._reset(now)
            if rejection is not None:
                return rejection
        elif kind in (_DATA, _HEADERS) and flags & _END_STREAM:
            self._ended[stream_id] = None
            if len(self._ended) > _ENDED_KEPT:
                del self._ended[next(iter(self._ended))]
        if kind == _HEADERS:
            self.last_stream_id = max(self.last_stream_id, stream_id)
            self._block = length
        elif kind == _CONTINUATION and self._block >= 0:
            self._block += length
        elif kind == _RST_STREAM:
            self._ended.pop(stream_id, None)
            return self._reset(now)
        if self._block > self._limits.max_header_block:
            return Rejection(
                431,
                f"HTTP/2 header block larger than {self._limits.max_header_block} bytes",
                "request_head_too_large",
            )
        if kind in (_HEADERS, _CONTINUATION) and flags & _END_HEADERS:
            self._block = -1
        return None

    def _reset(self, now: float) -> Rejection | None:
        limits = self._limits
        if self._last_time is not None:
            refill = (now - self._last_time) * limits.resets_per_s
            self._tokens = min(float(limits.reset_burst), self._tokens + refill)
        self._last_time = now
        self._tokens -= 1.0
        if self._tokens < 0:
            return Rejection(
                429,
                f"too many HTTP/2 stream resets (more than {limits.resets_per_s:g} a second)",
                "too_many_stream_resets",
                "h2_reset_flood",
            )
        return None


class _State(enum.Enum):
    HEAD = enum.auto()
    BODY = enum.auto()  # `_left` bytes of a Content-Length body
    CHUNK_SIZE = enum.auto()
    CHUNK_DATA = enum.auto()  # `_left` bytes of chunk data, then its CRLF
    TRAILERS = enum.auto()
    H2 = enum.auto()  # HTTP/2 prior knowledge: frames follow, watched by `_h2`
    PASSTHROUGH = enum.auto()  # HTTP/2 unwatched, or bytes h11 will reject: no more checks
    REJECTED = enum.auto()


class HeadScanner:
    """Follows one connection's request framing; checks and rewrites each head."""

    __slots__ = (
        "_buf",
        "_h2",
        "_h2_limits",
        "_left",
        "_max",
        "_scanned",
        "_state",
        "bodies",
        "body_length",
        "body_request_line",
    )  # fmt: skip

    def __init__(self, max_head_bytes: int, h2_limits: H2Limits | None = None) -> None:
        # HTTP/1.1 request heads seen that announced a body (the requests that cost),
        # and the request line of the last one (`POST /v1/chat/completions HTTP/1.1`).
        self.bodies = 0
        self.body_request_line = b""
        self.body_length = 0  # that request's Content-Length; -1: chunked
        self._max = max_head_bytes
        self._h2_limits = h2_limits
        self._h2: H2FrameWatch | None = None
        self._state = _State.HEAD
        self._buf = bytearray()
        self._scanned = 0  # how much of `_buf` was searched for the end already
        self._left = 0

    @property
    def checking(self) -> bool:
        """False once the connection speaks HTTP/2 or holds bytes h11 will refuse."""
        return self._state not in (_State.PASSTHROUGH, _State.REJECTED)

    @property
    def http2(self) -> H2FrameWatch | None:
        """The frame watch, once the connection speaks HTTP/2 (and limits were given)."""
        return self._h2

    @property
    def mid_head(self) -> bool:
        """Part of an HTTP/1.1 head has arrived, not its end."""
        return self._state is _State.HEAD and bool(self._buf)

    @property
    def in_body(self) -> bool:
        """An HTTP/1.1 request body (or its chunk framing) is still owed by the client."""
        return self._state in (_State.BODY, _State.CHUNK_SIZE, _State.CHUNK_DATA, _State.TRAILERS)

    def feed(self, data: bytes, now: float = 0.0) -> tuple[bytes, Rejection | None]:
        """The bytes to hand on now, and a rejection that ends the connection after them.

        `now` (seconds, any clock) only matters on HTTP/2, for the reset rate.
        """
        out: list[bytes] = []
        pos = 0
        end = len(data)
        while pos < end:
            state = self._state
            if state is _State.PASSTHROUGH:
                out.append(data[pos:])
                break
            if state is _State.H2:
                assert self._h2 is not None
                forward, rejection = self._h2.feed(data, pos, now)
                out.append(forward)
                if rejection is not None:
                    self._state = _State.REJECTED
                return b"".join(out), rejection
            if state is _State.REJECTED:
                break
            if state is _State.BODY or state is _State.CHUNK_DATA:
                take = min(self._left, end - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = _State.HEAD if state is _State.BODY else _State.CHUNK_SIZE
                continue
            # HEAD, CHUNK_SIZE, TRAILERS collect into `_buf` until a line or head ends.
            pos, rejection = self._collect(data, pos, out)
            if rejection is not None:
                self._state = _State.REJECTED
                return b"".join(out), rejection
        return b"".join(out), None

    def _collect(self, data: bytes, pos: int, out: list[bytes]) -> tuple[int, Rejection | None]:
        """Find the end of a head, chunk-size line or trailer section starting at `pos`.

        Bytes are searched where they lie: only a piece that straddles two
        receives is copied into `_buf` (so pipelined requests in one receive
        cost no copies of the rest of it).
        """
        src: bytes | bytearray
        if self._buf:
            shift = len(self._buf) - pos  # index in `src` minus index in `data`
            self._buf += data[pos:]
            src, base, search_from = self._buf, 0, max(0, self._scanned - 2)
        else:
            shift = 0
            src, base, search_from = data, pos, pos
        state = self._state
        if state is _State.CHUNK_SIZE or (
            state is _State.TRAILERS and src[base : base + 1] in (b"\n", b"\r")
        ):
            newline = src.find(b"\n", search_from)
            if newline < 0:
                return self._incomplete(src, base, len(data), out, head=False)
            line_end = newline + 1
            if state is _State.TRAILERS:
                # No trailer field: the last chunk ends at this empty line.
                self._state = _State.HEAD
            else:
                match = _CHUNK_SIZE.fullmatch(src, base, line_end)
                if match is None:
                    return self._pass_through(src, base, len(data), out)
                size = int(match.group(1), 16)
                # A chunk's data, then its CRLF (two bytes h11 checks itself).
                self._state = _State.TRAILERS if size == 0 else _State.CHUNK_DATA
                self._left = size + 2
            out.append(bytes(src[base:line_end]))
            self._reset_buf()
            return line_end - shift, None
        match = _BLANK_LINE.search(src, search_from)
        if match is None or match.end() - base > self._max + 4:
            return self._incomplete(src, base, len(data), out, head=state is _State.HEAD)
        head_end = match.end()
        head = bytes(src[base:head_end])
        self._reset_buf()
        if state is _State.TRAILERS:
            out.append(head)
            self._state = _State.HEAD
            return head_end - shift, None
        return head_end - shift, self._head(head, out)

    def _head(self, head: bytes, out: list[bytes]) -> Rejection | None:
        lines = head.split(b"\n")
        request_line = lines[0].rstrip(b"\r")
        if request_line == _H2_PREFACE_LINE or not request_line:
            # HTTP/2 with prior knowledge, or a leading empty line h11 refuses.
            out.append(head)
            self._state = _State.PASSTHROUGH
            if request_line and self._h2_limits is not None:
                self._h2 = H2FrameWatch(self._h2_limits)
                self._state = _State.H2
            return None
        kept = [lines[0]]
        lengths: list[bytes] = []
        chunked = False
        for line in lines[1:]:
            field = line.rstrip(b"\r")
            if not field:
                kept.append(line)
                continue
            if field[:1] in (b" ", b"\t"):
                return Rejection(400, "obsolete line folding in request headers", "bad_request")
            name, _sep, value = field.partition(b":")
            lname = name.lower()
            if lname == b"upgrade":
                continue  # no protocol switch is served: the request stays HTTP/1.1
            if lname == b"content-length":
                lengths.append(value.strip())
            elif lname == b"transfer-encoding":
                chunked = True
            kept.append(line)
        if chunked and lengths:
            return Rejection(
                400, "request has both Content-Length and Transfer-Encoding", "bad_request"
            )
        out.append(b"\n".join(kept))
        if chunked:
            self._has_body(request_line, -1)
            self._state = _State.CHUNK_SIZE
        elif lengths:
            if len(set(lengths)) != 1 or not lengths[0].isdigit() or len(lengths[0]) > 18:
                self._state = _State.PASSTHROUGH  # h11 answers 400 and closes
            elif (length := int(lengths[0])) > 0:
                self._has_body(request_line, length)
                self._state = _State.BODY
                self._left = length
        return None

    def _has_body(self, request_line: bytes, length: int) -> None:
        self.bodies += 1
        self.body_request_line = request_line
        self.body_length = length

    def _incomplete(
        self, src: bytes | bytearray, base: int, end: int, out: list[bytes], *, head: bool
    ) -> tuple[int, Rejection | None]:
        """No end yet: keep the piece for the next receive, unless it is too long."""
        if len(src) - base > self._max:
            if head:
                return end, Rejection(
                    431, f"request head larger than {self._max} bytes", "request_head_too_large"
                )
            return self._pass_through(src, base, end, out)
        if src is not self._buf:
            self._buf = bytearray(src[base:])
        self._scanned = len(self._buf)
        return end, None

    def _pass_through(
        self, src: bytes | bytearray, base: int, end: int, out: list[bytes]
    ) -> tuple[int, Rejection | None]:
        out.append(bytes(src[base:]))
        self._reset_buf()
        self._state = _State.PASSTHROUGH
        return end, None

    def _reset_buf(self) -> None:
        self._buf = bytearray()
        self._scanned = 0
