# The request-head checks of one HTTP/1.1 connection, as a pure state machine.
#
# Everything here is about bytes a client sent; no I/O, no trio. The serving
# loop feeds each received chunk to `HeadScanner.feed` and hands what comes
# back to hypercorn. The scanner follows the request framing (heads,
# Content-Length bodies, chunked bodies) only to know where each head starts:
# it looks at heads and never at a body's bytes. Work is linear in the bytes
# fed, and a head is buffered up to `max_head_bytes` at most.
"""Checks h11 does not make on request heads, done before hypercorn sees them.

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
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

# The end of a head, as h11 finds it: a blank line, CRLF or bare LF.
_BLANK_LINE = re.compile(rb"\n\r?\n")
_CHUNK_SIZE = re.compile(rb"[ \t]*([0-9A-Fa-f]{1,20})[ \t]*(?:;[^\r\n]*)?\r?\n")
_H2_PREFACE_LINE = b"PRI * HTTP/2.0"


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a head is refused: the status and message of the error answer."""

    status: int
    message: str
    code: str


class _State(enum.Enum):
    HEAD = enum.auto()
    BODY = enum.auto()  # `_left` bytes of a Content-Length body
    CHUNK_SIZE = enum.auto()
    CHUNK_DATA = enum.auto()  # `_left` bytes of chunk data, then its CRLF
    TRAILERS = enum.auto()
    PASSTHROUGH = enum.auto()  # HTTP/2, or bytes h11 will reject: no more checks
    REJECTED = enum.auto()


class HeadScanner:
    """Follows one connection's request framing; checks and rewrites each head."""

    __slots__ = ("_buf", "_left", "_max", "_scanned", "_state")

    def __init__(self, max_head_bytes: int) -> None:
        self._max = max_head_bytes
        self._state = _State.HEAD
        self._buf = bytearray()
        self._scanned = 0  # how much of `_buf` was searched for the end already
        self._left = 0

    @property
    def checking(self) -> bool:
        """False once the connection speaks HTTP/2 or holds bytes h11 will refuse."""
        return self._state not in (_State.PASSTHROUGH, _State.REJECTED)

    def feed(self, data: bytes) -> tuple[bytes, Rejection | None]:
        """The bytes to hand on now, and a rejection that ends the connection after them."""
        out: list[bytes] = []
        pos = 0
        end = len(data)
        while pos < end:
            state = self._state
            if state is _State.PASSTHROUGH:
                out.append(data[pos:])
                break
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
            self._state = _State.CHUNK_SIZE
        elif lengths:
            if len(set(lengths)) != 1 or not lengths[0].isdigit() or len(lengths[0]) > 18:
                self._state = _State.PASSTHROUGH  # h11 answers 400 and closes
            elif (length := int(lengths[0])) > 0:
                self._state = _State.BODY
                self._left = length
        return None

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
