"""The request-head checks: framing followed, heads checked, bodies untouched.

Like h11's own tests, the same bytes fed whole and in arbitrary pieces must
give the same result.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from edge.http.headcheck import H2Limits, HeadScanner, Rejection

MAX = 4096


def _scan(data: bytes, cuts: list[int] | None = None) -> tuple[bytes, Rejection | None]:
    scanner = HeadScanner(MAX)
    points = sorted({c for c in (cuts or []) if 0 < c < len(data)})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    out = bytearray()
    for piece in pieces:
        forward, rejection = scanner.feed(piece)
        out += forward
        if rejection is not None:
            return bytes(out), rejection
    return bytes(out), None


GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
POST_CL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n"
CHUNKED = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: t\r\n\r\n"
)


def test_good_requests_pass_unchanged() -> None:
    data = GET + POST_CL + b"hello world" + CHUNKED + GET
    assert _scan(data) == (data, None)


def test_a_body_that_looks_like_a_bad_head_is_not_looked_at() -> None:
    """Body bytes are framed, never read as headers."""
    body = b"X: a\r\n b\r\n\r\n"
    data = POST_CL.replace(b"11", str(len(body)).encode()) + body + GET
    assert _scan(data) == (data, None)


def test_content_length_with_transfer_encoding_is_refused() -> None:
    bad = b"POST / HTTP/1.1\r\ncontent-length: 3\r\nTRANSFER-ENCODING: chunked\r\n\r\n0\r\n\r\n"
    forward, rejection = _scan(GET + bad)
    assert forward == GET
    assert rejection is not None
    assert rejection.status == 400


def test_obsolete_line_folding_is_refused() -> None:
    for fold in (b" ", b"\t"):
        forward, rejection = _scan(b"GET / HTTP/1.1\r\nX: a\r\n" + fold + b"b\r\n\r\n")
        assert forward == b""
        assert rejection is not None
        assert "folding" in rejection.message


def test_a_head_past_the_limit_is_431() -> None:
    _forward, rejection = _scan(b"GET / HTTP/1.1\r\nX: " + b"a" * MAX)
    assert rejection is not None
    assert rejection.status == 431


def test_upgrade_is_dropped_so_no_protocol_switch_happens() -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    assert _scan(head) == (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n\r\n", None)


def test_http2_prior_knowledge_passes_through() -> None:
    data = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00 X: a\r\n b"
    assert _scan(data) == (data, None)


def test_unframeable_bytes_pass_through_for_h11_to_refuse() -> None:
    data = b"POST / HTTP/1.1\r\nContent-Length: x1\r\n\r\nGET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n"
    assert _scan(data) == (data, None)


_pieces = st.sampled_from(
    [GET, POST_CL + b"hello world", CHUNKED, b"GET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n",
     b"GET / HTTP/1.1\nHost: x\nUpgrade: websocket\n\n", b"\r\n", b"garbage"]
)  # fmt: skip


@given(st.lists(_pieces, max_size=6), st.lists(st.integers(0, 2000), max_size=12))
def test_pieces_or_whole_give_the_same_result(parts: list[bytes], cuts: list[int]) -> None:
    data = b"".join(parts)
    assert _scan(data, cuts) == _scan(data)


def test_many_pipelined_requests_in_one_receive_are_linear() -> None:
    """Ten thousand tiny chunks in one piece: each byte is looked at a bounded number
    of times (this would take minutes if the rest of the piece were copied per chunk)."""
    body = b"1\r\nx\r\n" * 10_000 + b"0\r\n\r\n"
    data = CHUNKED.split(b"\r\n\r\n")[0] + b"\r\n\r\n" + body
    assert _scan(data) == (data, None)


# --- HTTP/2 frames ------------------------------------------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2 = H2Limits(max_header_block=1000, reset_burst=3, resets_per_s=2.0)


def _frame(kind: int, stream_id: int, payload: bytes = b"", flags: int = 0) -> bytes:
    return (
        len(payload).to_bytes(3, "big")
        + bytes((kind, flags))
        + stream_id.to_bytes(4, "big")
        + (payload)
    )


def _headers(stream_id: int, size: int = 10, end: bool = True) -> bytes:
    return _frame(0x1, stream_id, b"h" * size, 0x4 if end else 0)


def _rst(stream_id: int) -> bytes:
    return _frame(0x3, stream_id, b"\0\0\0\x08")


def _scan_h2(
    data: bytes, cuts: list[int], times: list[float] | None = None
) -> tuple[bytes, Rejection | None, HeadScanner]:
    scanner = HeadScanner(MAX, H2)
    points = sorted({c for c in cuts if 0 < c < len(data)})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    out = bytearray()
    for n, piece in enumerate(pieces):
        forward, rejection = scanner.feed(piece, (times or [0.0] * len(pieces))[n])
        out += forward
        if rejection is not None:
            return bytes(out), rejection, scanner
    return bytes(out), None, scanner


_TRAFFIC = (
    PREFACE
    + _frame(0x4, 0, b"\0" * 6)  # SETTINGS
    + _headers(1, end=False)
    + _frame(0x9, 1, b"c" * 500, 0x4)  # CONTINUATION ending the block
    + _frame(0x0, 1, b"DATA \x03\x01\x09 is no frame header", 0x1)
    + _headers(3)
    + _rst(3)
    + _rst(1)
)


@given(st.lists(st.integers(0, len(_TRAFFIC)), max_size=20))
def test_h2_frames_within_limits_pass_unchanged_in_any_pieces(cuts: list[int]) -> None:
    out, rejection, scanner = _scan_h2(_TRAFFIC, cuts)
    assert (out, rejection) == (_TRAFFIC, None)
    assert scanner.http2 is not None
    assert scanner.http2.last_stream_id == 3


@given(st.lists(st.integers(0, 2000), max_size=20))
def test_h2_header_block_past_the_limit_is_refused_before_its_frame(cuts: list[int]) -> None:
    """The CONTINUATION that takes the block past the limit is not handed on."""
    good = PREFACE + _headers(1, size=600, end=False)
    data = good + _frame(0x9, 1, b"c" * 600) + _frame(0x9, 1, b"c" * 600, 0x4)
    out, rejection, _ = _scan_h2(data, cuts)
    assert out == good
    assert rejection is not None
    assert rejection.status == 431
    assert rejection.kind == "bad_request"


def test_h2_resets_past_the_burst_then_the_rate_are_refused() -> None:
    """A burst of 3, then 2 a second: the 4th reset at once is refused; after a
    second, two more are allowed."""
    burst = PREFACE + b"".join(_headers(n) + _rst(n) for n in (1, 3, 5))
    out, rejection, _ = _scan_h2(burst + _headers(7) + _rst(7), [len(burst)], [0.0, 0.0])
    assert rejection is not None
    assert rejection.kind == "h2_reset_flood"
    assert out == burst + _headers(7)
    later = b"".join(_headers(n) + _rst(n) for n in (7, 9))
    out, rejection, _ = _scan_h2(burst + later, [len(burst)], [0.0, 1.0])
    assert (out, rejection) == (burst + later, None)


def test_h2_goes_unwatched_without_limits() -> None:
    scanner = HeadScanner(MAX)
    data = PREFACE + b"".join(_headers(n) + _rst(n) for n in range(1, 99, 2))
    assert scanner.feed(data) == (data, None)
    assert scanner.http2 is None


def test_the_scanner_says_when_a_head_or_a_body_is_owed() -> None:
    """What the serving loop's time limits go by."""
    scanner = HeadScanner(MAX)
    assert (scanner.mid_head, scanner.in_body) == (False, False)
    scanner.feed(POST_CL[:10])
    assert (scanner.mid_head, scanner.in_body) == (True, False)
    scanner.feed(POST_CL[10:] + b"hello")
    assert (scanner.mid_head, scanner.in_body) == (False, True)
    scanner.feed(b" world")
    assert (scanner.mid_head, scanner.in_body) == (False, False)


def test_h2_frames_on_a_stream_the_client_ended_count_as_resets() -> None:
    """DATA after END_STREAM makes h2 reset the stream: a burst of 3 such frames,
    then the 4th at once is refused; a stream that is not ended takes DATA freely."""
    ended = b"".join(_headers(n) + _frame(0x0, n, b"x", 0x1) for n in (1, 3, 5, 7))
    provoke = b"".join(_frame(0x0, n, b"late") for n in (1, 3, 5))
    out, rejection, _ = _scan_h2(PREFACE + ended + provoke + _frame(0x0, 7, b"late"), [])
    assert out == PREFACE + ended + provoke
    assert rejection is not None
    assert rejection.kind == "h2_reset_flood"
    open_stream = _headers(9) + b"".join(_frame(0x0, 9, b"more") for _ in range(10))
    assert _scan_h2(PREFACE + open_stream, [])[:2] == (PREFACE + open_stream, None)


def test_heads_with_a_body_are_counted_with_their_request_line() -> None:
    """The server sheds or paces a request by its head alone: the scanner counts the
    heads that announce a body (Content-Length > 0 or chunked) and keeps the last one's
    request line; bodyless requests (a GET, a zero length) are not counted."""
    scanner = HeadScanner(MAX)
    scanner.feed(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    scanner.feed(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert (scanner.bodies, scanner.body_request_line) == (0, b"")
    scanner.feed(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    assert (scanner.bodies, scanner.body_request_line) == (
        1, b"POST /v1/chat/completions HTTP/1.1",
    )  # fmt: skip
    scanner.feed(b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert (scanner.bodies, scanner.body_request_line) == (2, b"POST /b HTTP/1.1")
