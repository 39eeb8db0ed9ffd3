"""A small OTLP/HTTP trace receiver for tests: what the processes under test export.

`OtlpReceiver` is an HTTP server on 127.0.0.1 (its own thread) that takes
`POST /v1/traces`, decodes the body as an `ExportTraceServiceRequest` with
the opentelemetry-proto package (as a collector would), answers with an
`ExportTraceServiceResponse`, and keeps every span as a `ReceivedSpan`.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

# OTLP's span kinds, by their protobuf number.
KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, as a test reads it (ids in hex)."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status_code: int  # 0 unset, 1 ok, 2 error

    def event(self, name: str) -> dict[str, Any]:
        for event_name, attributes in self.events:
            if event_name == name:
                return attributes
        raise AssertionError(f"no event {name!r} on {self.name}: {self.events}")


@dataclass
class OtlpReceiver:
    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(_span(service, span))
        with self._lock:
            self.requests += 1
            self.spans.extend(received)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    async def wait_spans(
        self, trace_id: str, count: int, within_s: float = 10.0
    ) -> list[ReceivedSpan]:
        """The spans of `trace_id`, once at least `count` arrived (other processes export
        them from their own threads: polled, bounded)."""
        with trio.fail_after(within_s):
            while len(spans := self.trace(trace_id)) < count:  # noqa: ASYNC110 - a thread's list
                await trio.sleep(0.02)
        return spans


def _span(service: str, span: Span) -> ReceivedSpan:
    return ReceivedSpan(
        service=service,
        name=span.name,
        kind=KINDS.get(span.kind, str(span.kind)),
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        attributes=_attributes(span.attributes),
        events=[(e.name, _attributes(e.attributes)) for e in span.events],
        status_code=span.status.code,
    )


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A receiver listening on an ephemeral 127.0.0.1 port for the block's duration."""
    receiver = OtlpReceiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the stdlib's naming
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            receiver.add(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
