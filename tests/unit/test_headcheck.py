"""The request-head checks: framing followed, heads checked, bodies untouched.

Like h11's own tests, the same bytes fed whole and in arbitrary pieces must
give the same result.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from edge.http.headcheck import HeadScanner, Rejection

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
