"""A recording pass-through in front of the edge, for `make agents`.

The agents talk to this proxy; it forwards each request to the edge as sent
(method, path with its query, headers, body), streams the edge's answer back
chunk by chunk as it arrives (SSE stays a stream), and keeps every request
with its response status. The driver reads the records to see what each
agent declared (its tool names) and sent back (the tool's result); the
edge itself never logs prompts or tool output.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

MAX_BODY = 32 * 1024 * 1024
# Hop-by-hop headers: the proxy frames its own answer (chunked).
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "te",
                  "trailer", "upgrade", "proxy-connection"})  # fmt: skip


@dataclass
class Exchange:
    """One request an agent sent, and the status the edge answered."""

    method: str
    path: str
    body: bytes
    status: int = 0

    def json(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.body)
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}


class RecordingProxy:
    """A threaded HTTP/1.1 server on 127.0.0.1 that forwards to `upstream` and records."""

    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        assert target.hostname is not None
        assert target.port is not None
        host: str = target.hostname
        port: int = target.port
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the driver prints what it needs

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(min(length, MAX_BODY)) if length else b""
                exchange = Exchange(self.command, self.path, body)
                with proxy._lock:
                    proxy.exchanges.append(exchange)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                headers["Content-Length"] = str(len(body))
                upstream_conn = http.client.HTTPConnection(host, port, timeout=120)
                try:
                    upstream_conn.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream_conn.getresponse()
                    exchange.status = answer.status
                    self.send_response(answer.status, answer.reason)
                    for key, value in answer.getheaders():
                        if key.lower() not in _HOP:
                            self.send_header(key, value)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while chunk := answer.read1(65536):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                finally:
                    upstream_conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def posts(self, path_prefix: str) -> list[Exchange]:
        """The POSTs whose path starts with `path_prefix`, in the order they arrived."""
        with self._lock:
            return [
                e for e in self.exchanges if e.method == "POST" and e.path.startswith(path_prefix)
            ]
