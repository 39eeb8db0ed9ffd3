"""Error answers written on the socket directly; connection errors counted without a storm.

How the HTTP server says no: the answers it writes itself, without hypercorn
(OpenAI-shaped HTTP/1.1 errors, the `overloaded` answer of a request shed
before it is parsed, an HTTP/2 GOAWAY), and the count and rate-limited log
line of each connection it closes. Every whole HTTP/1.1 answer is built by
`http_answer`. No I/O but logging; knows nothing of connections, nor of the
app beyond the APIs' paths and error shapes (`edge.api.surfaces`).
"""

from __future__ import annotations

import json

import msgspec
import trio
from loguru import logger

from edge.api.surfaces import APIS
from edge.errors import error_object
from edge.fleet.admission import Admission
from edge.observe.metrics import EdgeMetrics

_LOG_INTERVAL_S = 1.0
_GOAWAY = 0x7
_API_PATHS = {path.encode(): api for path, api in APIS.items()}


def http_answer(
    status: int,
    body: bytes,
    *,
    reason: str | None = None,
    retry_after_s: int = 0,
    close: bool = True,
) -> bytes:
    """A whole HTTP/1.1 JSON answer, written by the server itself: Retry-After when
    `retry_after_s` is set; closing the connection unless `close` is False. `reason`:
    the status line's (by default the status's own in `REASONS`)."""
    if reason is None:
        reason = REASONS.get(status, "Error")
    retry = f"retry-after: {retry_after_s}\r\n" if retry_after_s > 0 else ""
    closing = "connection: close\r\n" if close else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{retry}{closing}\r\n"
    )
    return head.encode("ascii") + body


def error_response(
    status: int,
    reason: str,
    message: str,
    code: str,
    err_type: str,
    *,
    retry_after_s: int = 0,
    close: bool = True,
) -> bytes:
    """A complete HTTP/1.1 answer with an OpenAI-shaped body, closing the connection
    (unless `close` is False)."""
    body = json.dumps(error_object(err_type, message, code=code)).encode()
    return http_answer(status, body, reason=reason, retry_after_s=retry_after_s, close=close)


def shed_at_once(admission: Admission, request_line: bytes, *, close: bool) -> bytes | None:
    """For the HTTP server, before it parses a request: the whole HTTP/1.1 answer
    to a `POST` of one of the APIs that `admission.shed_if_full` would shed, or None.
    The same `overloaded` answer with Retry-After (in the API's own error shape), in a
    few scheduler passes instead of the request's whole way through the HTTP
    stack; `close`: the answer closes the connection."""
    method, _, rest = request_line.partition(b" ")
    path = rest.rpartition(b" ")[0].partition(b"?")[0]
    api = _API_PATHS.get(path) if method == b"POST" else None
    if api is None:
        return None
    error = admission.shed_now()
    if error is None:
        return None
    status, body = api.edge_error(error)
    return http_answer(
        status, msgspec.json.encode(body), retry_after_s=error.retry_after_s, close=close
    )


def goaway_frame(last_stream_id: int, error_code: int, debug: bytes) -> bytes:
    """An HTTP/2 GOAWAY frame (RFC 9113 6.8): the last stream served, why, and a note."""
    payload = last_stream_id.to_bytes(4, "big") + error_code.to_bytes(4, "big") + debug
    return len(payload).to_bytes(3, "big") + bytes((_GOAWAY, 0)) + (0).to_bytes(4, "big") + payload


REASONS = {
    400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
    503: "Service Unavailable", 529: "Overloaded",
}  # fmt: skip


def over_limit_response() -> bytes:
    """The 503 a connection past `max_connections` gets before it is closed."""
    return error_response(
        503, "Service Unavailable", "the server has too many open connections; retry later",
        "too_many_connections", "service_unavailable",
    )  # fmt: skip


class ConnectionErrors:
    """Counts connection errors by kind and logs at most one line per kind per second."""

    def __init__(self, metrics: EdgeMetrics) -> None:
        self._counter = metrics.connection_errors
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def record(self, kind: str, detail: str) -> None:
        self._counter.labels(kind).inc()
        now = trio.current_time()
        last = self._last.get(kind)
        if last is not None and now - last < _LOG_INTERVAL_S:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        more = self._suppressed.pop(kind, 0)
        suffix = f" ({more} more since the last line)" if more else ""
        logger.warning("connection closed ({}): {}{}", kind, detail, suffix)


def describe(exc: BaseException) -> str:
    """One line naming an exception; `repr` escapes control characters a client may have sent."""
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return describe(exc.exceptions[0])
    return f"{type(exc).__name__}: {str(exc)[:200]!r}"
