"""The HTTP server's own bookkeeping: connection errors counted, logged without a storm."""

from __future__ import annotations

import json

import trio
import trio.testing
from hyperframe.frame import Frame, GoAwayFrame
from loguru import logger

from edge.errors import error_object
from edge.http.refusals import ConnectionErrors, error_response, goaway_frame
from edge.observe.metrics import EdgeMetrics
from edge.process.listeners import default_max_connections


def test_connection_errors_are_all_counted_but_logged_once_a_second_per_kind() -> None:
    metrics = EdgeMetrics()
    errors = ConnectionErrors(metrics)
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), format="{message}")
    clock = trio.testing.MockClock()

    async def main() -> None:
        for _ in range(5):
            errors.record("accept_fd_exhausted", "accept failed: Too many open files")
        errors.record("over_limit", "3 connections open")
        clock.jump(1.5)
        errors.record("accept_fd_exhausted", "accept failed: Too many open files")

    try:
        trio.run(main, clock=clock)
    finally:
        logger.remove(sink)
    fd_lines = [line for line in lines if "accept_fd_exhausted" in line]
    assert len(fd_lines) == 2
    assert "4 more since the last line" in fd_lines[1]
    assert sum("over_limit" in line for line in lines) == 1
    value = metrics.registry.get_sample_value(
        "iop_edge_connection_errors_total", {"kind": "accept_fd_exhausted"}
    )
    assert value == 6


def test_default_max_connections_keeps_a_reserve_of_descriptors() -> None:
    assert default_max_connections(1024) == 1024 - 128
    assert default_max_connections(100) == 16


def test_error_response_is_complete_http_with_an_openai_error() -> None:
    """A whole HTTP/1.1 answer that closes the connection; its body is the OpenAI error
    object the app's own errors carry."""
    raw = error_response(400, "Bad Request", 'bad "head"', "bad_request", "invalid_request_error")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert f"content-length: {len(body)}".encode() in head
    assert b"connection: close" in head
    assert body.startswith(b'{"error": {"message": "bad \\"head\\""')
    assert json.loads(body) == error_object(
        "invalid_request_error", 'bad "head"', code="bad_request"
    )


def test_goaway_frame_parses_as_http2() -> None:
    raw = goaway_frame(7, 0xB, b"too many resets")
    frame, length = Frame.parse_frame_header(memoryview(raw[:9]))
    frame.parse_body(memoryview(raw[9 : 9 + length]))
    assert isinstance(frame, GoAwayFrame)
    assert (frame.last_stream_id, frame.error_code) == (7, 0xB)
    assert frame.additional_data == b"too many resets"
    assert len(raw) == 9 + length
