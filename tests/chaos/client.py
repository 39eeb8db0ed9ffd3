"""The chaos client: one raw HTTP/1.1 connection per stream, driven by its plan.

A plain socket with h11 on top (not httpx) so the client decides exactly
when it stops reading and how it leaves: a FIN or a RST, before the first
byte, after N content frames, right after the finish chunk. It records what
it saw, frame by frame, and judges nothing: `checks` does that.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

from tests.chaos.plan import TOTAL_S, Plan

# No stream may take longer than this on the client's side: the edge ends
# every run by total_s, so a client still waiting past it found a hung stream.
CLIENT_LIMIT_S = TOTAL_S + 10.0


@dataclass(eq=False)
class StreamResult:
    """What one client saw.

    `ended` is how the client's side ended: `eof` (the response was read to
    its end), `cut` (the client left as planned), `broken` (the connection
    closed before the response ended), `hung` (CLIENT_LIMIT_S passed),
    `connect_error`, or `load_bound` (the run's duration bound cut it).
    """

    plan: Plan
    request_id: str
    t_sent: float = 0.0
    t_end: float = 0.0
    # When the response head (its first byte) arrived; None: it never did.
    t_head: float | None = None
    # When the client stopped reading (a plan's stall); None: it did not.
    t_stall: float | None = None
    ended: str = ""
    status: int | None = None
    run_id: str | None = None
    ids: set[str] = field(default_factory=set)
    payloads: list[str] = field(default_factory=list)  # SSE data payloads, in order
    keepalives: int = 0
    content: str = ""
    content_frames: int = 0
    reasoning: str = ""
    # Tool calls by index: [name, arguments so far].
    tool_calls: dict[int, list[str]] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: Any = None  # the stream's usage object, when it sent one
    # When each frame of the answer (content, reasoning or a tool call) arrived.
    answer_times: list[float] = field(default_factory=list)
    body: Any = None  # the JSON body of a non-SSE answer
    problems: list[str] = field(default_factory=list)
    cut_reason: str = ""
    local_port: int = 0  # the client's port: names the connection in the edge's socket table

    @property
    def read_to_end(self) -> bool:
        return self.ended == "eof"


class _SSE:
    """Splits SSE bytes into frames; records payloads into a StreamResult."""

    def __init__(self, result: StreamResult, t0: float) -> None:
        self._buf = b""
        self._result = result
        self._t0 = t0
        self.finished = False  # a finish chunk was seen

    def feed(self, data: bytes) -> None:
        self._buf += data
        *frames, self._buf = self._buf.split(b"\n\n")
        for raw in frames:
            self._frame(raw)

    def leftover(self) -> bytes:
        return self._buf

    def _frame(self, raw: bytes) -> None:
        r = self._result
        text = raw.decode("utf-8", "replace")
        if text.startswith(":"):
            r.keepalives += 1
            return
        if not text.startswith("data: ") or "\n" in text:
            r.problems.append(f"bad SSE frame {text[:80]!r}")
            return
        payload = text[len("data: ") :]
        r.payloads.append(payload)
        if payload == "[DONE]":
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            r.problems.append(f"frame is not JSON: {payload[:80]!r}")
            return
        if not isinstance(obj, dict):
            r.problems.append(f"frame is not an object: {payload[:80]!r}")
            return
        if "id" in obj:
            r.ids.add(str(obj["id"]))
            if r.run_id is None and str(obj["id"]).startswith("chatcmpl-"):
                r.run_id = str(obj["id"]).removeprefix("chatcmpl-")
        if obj.get("usage"):
            r.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            answered = False
            if delta.get("content"):
                r.content += delta["content"]
                r.content_frames += 1
                answered = True
            if delta.get("reasoning_content"):
                r.reasoning += delta["reasoning_content"]
                answered = True
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                name, args = r.tool_calls.setdefault(int(call.get("index", 0)), ["", ""])
                r.tool_calls[int(call.get("index", 0))] = [
                    name + str(function.get("name") or ""),
                    args + str(function.get("arguments") or ""),
                ]
                answered = True
            if answered:
                r.answer_times.append(trio.current_time() - self._t0)
            if choice.get("finish_reason"):
                r.finish_reason = str(choice["finish_reason"])
                self.finished = True


def _request_bytes(conn: h11.Connection, plan: Plan, request_id: str, port: int) -> bytes:
    body = plan.body
    headers = [
        ("Host", f"127.0.0.1:{port}"),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
        ("X-Request-Id", request_id),
    ]
    if plan.idle_close_s is None:
        headers.append(("Connection", "close"))
    head = conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers))
    assert head is not None
    data = conn.send(h11.Data(data=body))
    end = conn.send(h11.EndOfMessage())
    assert data is not None
    assert end is not None
    return head + data + end


async def run_stream(result: StreamResult, port: int, t0: float) -> None:
    """Run `result.plan` against the edge on 127.0.0.1:`port`, filling `result` in.

    Times are relative to `t0`. When the caller cancels (the duration bound),
    the client leaves like a disconnect and `result.ended` says `load_bound`.
    """
    plan = result.plan
    try:
        sock = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError as exc:
        result.ended = "connect_error"
        result.problems.append(f"connect: {exc}")
        result.t_sent = result.t_end = trio.current_time() - t0
        return
    cut = plan.cut
    result.local_port = sock.socket.getsockname()[1]
    try:
        conn = h11.Connection(h11.CLIENT)
        await sock.send_all(_request_bytes(conn, plan, result.request_id, port))
        result.t_sent = trio.current_time() - t0
        limit = CLIENT_LIMIT_S
        timed_cut = cut is not None and cut.after_s is not None
        if cut is not None and cut.after_s is not None:
            limit = cut.after_s
        with trio.move_on_after(limit) as scope:
            result.ended = await _read(sock, conn, plan, result, t0)
        if scope.cancelled_caught:
            result.ended = "cut" if timed_cut else "hung"
            result.cut_reason = "after_s" if timed_cut else ""
        elif result.ended == "cut" and cut is not None and cut.then_s > 0:
            await trio.sleep(cut.then_s)  # not reading: the edge may hold text back meanwhile
        elif result.ended == "eof" and plan.idle_close_s is not None:
            await trio.sleep(plan.idle_close_s)  # an idle keep-alive connection, then FIN
    except trio.Cancelled:
        result.ended = "load_bound"
        raise
    finally:
        if cut is not None and cut.reset and result.ended in ("cut", "load_bound"):
            # SO_LINGER 0: close() sends a RST instead of a FIN.
            sock.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.socket.close()
        result.t_end = trio.current_time() - t0


async def _read(
    sock: trio.SocketStream, conn: h11.Connection, plan: Plan, result: StreamResult, t0: float
) -> str:
    """Read the response until its end, or until the plan's cut; returns how it ended."""
    cut = plan.cut
    sse: _SSE | None = None
    body = b""
    received = 0
    stall_at = plan.stall_after_bytes
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            result.problems.append(f"HTTP: {exc}")
            return "broken"
        if event is h11.NEED_DATA:
            try:
                data = await sock.receive_some(plan.read_size)
            except (trio.BrokenResourceError, OSError) as exc:
                result.problems.append(f"recv: {exc}")
                return "broken"
            conn.receive_data(data)
            received += len(data)
            if plan.read_pause_s and data:
                await trio.sleep(plan.read_pause_s)
            if stall_at is not None and received >= stall_at:
                stall_at = None
                result.t_stall = trio.current_time() - t0
                await trio.sleep(plan.stall_s)
            continue
        if isinstance(event, h11.Response):
            result.t_head = trio.current_time() - t0
            result.status = event.status_code
            ctype = dict(event.headers).get(b"content-type", b"")
            if event.status_code == 200 and ctype.startswith(b"text/event-stream"):
                sse = _SSE(result, t0)
        elif isinstance(event, h11.Data):
            if sse is None:
                body += bytes(event.data)
                continue
            sse.feed(bytes(event.data))
            if cut is not None:
                if cut.on_finish and sse.finished:
                    result.cut_reason = "on_finish"
                    return "cut"
                if cut.after_content is not None and result.content_frames >= cut.after_content:
                    result.cut_reason = "after_content"
                    return "cut"
        elif isinstance(event, h11.EndOfMessage):
            if sse is not None and sse.leftover():
                result.problems.append(f"unterminated SSE frame {sse.leftover()[:80]!r}")
            if sse is None:
                _body(result, body)
            return "eof"
        elif isinstance(event, h11.ConnectionClosed):
            return "broken"


def _body(result: StreamResult, body: bytes) -> None:
    try:
        result.body = json.loads(body)
    except ValueError:
        result.problems.append(f"body is not JSON: {body[:80]!r}")
        return
    if isinstance(result.body, dict) and str(result.body.get("id", "")).startswith("chatcmpl-"):
        result.run_id = str(result.body["id"]).removeprefix("chatcmpl-")
