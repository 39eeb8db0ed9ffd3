"""The span of one API request at the edge: `RequestTrace`.

Made only when tracing is on (`edge.observe.tracing`): the request's scope
(`edge.http.scope.ChatScope`) holds one, or None, and every hook below is
called behind one `if` per request. Nothing here runs per chunk: the first
token's time is read from the run when the span ends, and output text is
kept only with `capture_content` (its streamer is wrapped for that).

The span is a SERVER span named `{gen_ai.operation.name} {gen_ai.request.model}`
(e.g. `chat sim-echo`) with the GenAI semantic conventions' attributes, the
HTTP ones, and events, each at the time it happened:

- `queued`: no node slot was free; the request waited in the admission queue.
- `node picked` (`iop.node`, `iop.attempt`), and before each failover retry
  `failover retry` (`iop.node`: the node given up, `iop.retry.reason`).
- `run accepted` (the node took the run), or `run start failed` (`error.type`).
- `first token`: the node's first event of the answering run.
- `end` (`iop.end_cause`): the node ended the run (`node`), or the edge did:
  `client_disconnected`, `timeout`, `slow_client`, `shutdown`, `stream_broken`.

It continues the client's `traceparent` and gives its own to the node (the
Run call's gRPC metadata): `node_metadata`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

import trio
from hypercorn.typing import HTTPScope
from opentelemetry.trace import Span, SpanKind

from edge.api.request import ChatRequest
from edge.api.surfaces import Folder, Streamer
from edge.fleet.answer import Mark
from edge.fleet.run import Run
from edge.observe.tracing import (
    OPERATION,
    PROVIDER,
    Tracing,
    extract,
    header_map,
    inject,
    set_error,
)
from edge.stream.output import ContentOut, ErrorOut, OutEvent, ReasoningOut, ToolCallsOut

__all__ = ["RequestTrace"]

# Captured prompt or completion text, per attribute, in characters (capture_content).
MAX_CAPTURED_CHARS = 64 * 1024
# The response id each API gives its answer, from the run id.
_RESPONSE_ID = {"chat": "chatcmpl-{}", "responses": "resp_{}", "messages": "msg_{}"}
# A model name in a span name, at most (it is the caller's string).
_MAX_MODEL_CHARS = 128


def _wall_ns(at: float) -> int:
    """The wall-clock time (ns) of trio clock time `at`."""
    return time.time_ns() - int((trio.current_time() - at) * 1e9)


def _capped(text: str) -> str:
    return text if len(text) <= MAX_CAPTURED_CHARS else text[:MAX_CAPTURED_CHARS] + "..."


class RequestTrace:
    """The span of one API request (see the module doc)."""

    __slots__ = (
        "_kept", "_output", "_reasoning", "_tools", "api",
        "capture", "error_code", "error_type", "span",
    )  # fmt: skip

    def __init__(self, span: Span, api: str, *, capture: bool) -> None:
        self.span = span
        self.api = api
        self.capture = capture
        # The EdgeError type and code the request was answered with (set by the app).
        self.error_type: str | None = None
        self.error_code: str | None = None
        self._output: list[str] = []
        self._reasoning: list[str] = []
        self._tools: list[dict[str, Any]] = []
        self._kept = 0  # characters of output kept (capture_content)

    @classmethod
    def begin(cls, tracing: Tracing, scope: HTTPScope, api: str) -> RequestTrace:
        """The span of the request `scope` describes, continuing its `traceparent`."""
        headers = header_map(scope["headers"])
        user_agent = ""
        for name, value in scope["headers"]:
            if name.lower() == b"user-agent":
                user_agent = value.decode("latin-1")
                break
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": OPERATION,
            "gen_ai.provider.name": PROVIDER,
            "http.request.method": scope["method"],
            "http.route": scope["path"],
            "url.path": scope["path"],
            "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", "1.1"),
            "iop.api": api,
        }
        if user_agent:
            attributes["user_agent.original"] = user_agent
        server = scope.get("server")
        if server is not None and server[1] is not None:
            attributes["server.address"], attributes["server.port"] = server
        client = scope.get("client")
        if client is not None:
            attributes["client.address"], attributes["client.port"] = client
        span = tracing.tracer.start_span(
            OPERATION, context=extract(headers), kind=SpanKind.SERVER, attributes=attributes
        )
        return cls(span, api, capture=tracing.capture_content)

    @property
    def node_metadata(self) -> dict[str, str]:
        """The trace context to send with the Run call: the node's span is our child."""
        return inject(self.span)

    # --- the request ----------------------------------------------------------------

    def request(self, request: ChatRequest) -> None:
        """The parsed request: the span's name, the model and the parameters set."""
        model = request.model[:_MAX_MODEL_CHARS]
        span = self.span
        span.update_name(f"{OPERATION} {model}")
        attributes: dict[str, Any] = {"gen_ai.request.model": model, "iop.stream": request.stream}
        for key, value in (
            ("gen_ai.request.max_tokens", request.max_tokens),
            ("gen_ai.request.temperature", request.temperature),
            ("gen_ai.request.top_p", request.top_p),
            ("gen_ai.request.seed", request.seed),
            ("gen_ai.request.presence_penalty", request.presence_penalty),
            ("gen_ai.request.frequency_penalty", request.frequency_penalty),
        ):
            if value is not None:
                attributes[key] = value
        if request.stop:
            attributes["gen_ai.request.stop_sequences"] = list(request.stop)
        if self.capture:
            messages = [
                {"role": m.role, "parts": [{"type": "text", "content": m.text()}]}
                for m in request.messages
            ]
            attributes["gen_ai.input.messages"] = _capped(json.dumps(messages, ensure_ascii=False))
        span.set_attributes(attributes)

    # --- the answer's journal ------------------------------------------------------

    def _journal(self, journal: Sequence[Mark]) -> None:
        """What happened to the answer (`Answer.journal`), as span events at their times."""
        span = self.span
        migrations = 0
        for mark in journal:
            at = _wall_ns(mark.at)
            what = mark.what
            if what == "picked":
                attributes: dict[str, Any] = {"iop.node": mark.node, "iop.attempt": mark.attempt}
                span.add_event("node picked", attributes, timestamp=at)
            elif what == "accepted":
                span.add_event("run accepted", {"iop.node": mark.node}, timestamp=at)
            elif what == "start_failed":
                attributes = {"iop.node": mark.node, "error.type": mark.why}
                span.add_event("run start failed", attributes, timestamp=at)
            elif what == "retried":
                attributes = {"iop.node": mark.node, "iop.retry.reason": mark.why}
                span.add_event("failover retry", attributes, timestamp=at)
            elif what == "migrated":
                migrations += 1
                span.add_event(
                    "run migrated",
                    {"iop.node": mark.node, "iop.migration.to_node": mark.to_node,
                     "iop.migration.reason": mark.why,
                     "iop.migration.delivered_chars": mark.chars},
                    timestamp=at,
                )  # fmt: skip
            else:
                span.add_event("queued", timestamp=at)
        if migrations:
            span.set_attribute("iop.migrations", migrations)

    # --- output (capture_content only) ---------------------------------------------

    def capturing_streamer(self, streamer: Streamer) -> Streamer:
        return _CapturingStreamer(streamer, self)

    def capturing_folder(self, folder: Folder) -> Folder:
        return _CapturingFolder(folder, self)

    def _take(self, events: Iterable[OutEvent]) -> None:
        # What is kept is bounded: past MAX_CAPTURED_CHARS the attribute is cut anyway.
        for event in events:
            if self._kept >= MAX_CAPTURED_CHARS:
                return
            if isinstance(event, ContentOut):
                self._output.append(event.text)
                self._kept += len(event.text)
            elif isinstance(event, ReasoningOut):
                self._reasoning.append(event.text)
                self._kept += len(event.text)
            elif isinstance(event, ToolCallsOut):
                for c in event.calls:
                    self._tools.append(
                        {"type": "tool_call", "id": c.id, "name": c.name, "arguments": c.arguments}
                    )
                    self._kept += len(c.arguments) + len(c.name)

    # --- the end ----------------------------------------------------------------------

    def end(
        self, http_status: int, run: Run | None, attempts: Sequence[Run], journal: Sequence[Mark]
    ) -> None:
        """The request's cycle is over: what happened to its answer, and its outcome, on
        the span, which ends."""
        span = self.span
        self._journal(journal)
        if http_status:
            span.set_attribute("http.response.status_code", http_status)
        span.set_attribute("iop.attempts", len(attempts))
        if self.error_code:
            span.set_attribute("iop.error.code", self.error_code)
        outcome = run.outcome if run is not None else None
        if run is None or outcome is None:
            if http_status >= 400 or http_status == 0:
                error = self.error_type or (str(http_status) if http_status else "cancelled")
                set_error(span, error)
            span.end()
            return
        info = run.info
        attributes: dict[str, Any] = {
            "gen_ai.response.model": info.model[:_MAX_MODEL_CHARS],
            "gen_ai.response.id": _RESPONSE_ID.get(self.api, "{}").format(info.run_id),
            "iop.node": info.node,
            "iop.run_id": info.run_id,
            "iop.outcome": outcome.status,
        }
        if outcome.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = [outcome.finish_reason]
        if outcome.usage is not None and outcome.usage_sample:
            attributes["gen_ai.usage.input_tokens"] = outcome.usage.input_tokens
            attributes["gen_ai.usage.output_tokens"] = outcome.usage.output_tokens
        if self.capture and (self._output or self._reasoning or self._tools):
            parts: list[dict[str, Any]] = []
            if self._reasoning:
                parts.append({"type": "reasoning", "content": "".join(self._reasoning)})
            if self._output:
                parts.append({"type": "text", "content": "".join(self._output)})
            parts.extend(self._tools)
            message = {
                "role": "assistant", "parts": parts, "finish_reason": outcome.finish_reason or "",
            }  # fmt: skip
            attributes["gen_ai.output.messages"] = _capped(
                json.dumps([message], ensure_ascii=False)
            )
        span.set_attributes(attributes)
        first = run.reader.first_event_at
        if first is not None:
            span.add_event("first token", timestamp=_wall_ns(first))
        handle = run.reader.handle
        if handle is not None:
            cause = handle.cause
            end_cause = str(cause) if cause is not None else "node"
            if handle.error is not None and cause is None:
                end_cause = "stream_broken"
            span.add_event("end", {"iop.end_cause": end_cause})
        if outcome.status != "success":
            error = outcome.error_type or self.error_type or outcome.status
            if outcome.status == "cancelled":
                span.set_attribute("error.type", error)  # the caller left: not the edge's fault
            else:
                set_error(span, error)
        elif http_status >= 500:
            set_error(span, self.error_type or str(http_status))
        span.end()


class _CapturingStreamer:
    """A streamer that also keeps the output text for the span (capture_content)."""

    __slots__ = ("_inner", "_trace")

    def __init__(self, inner: Streamer, trace: RequestTrace) -> None:
        self._inner = inner
        self._trace = trace

    @property
    def keepalive(self) -> bytes:
        return self._inner.keepalive

    def encode(self, events: Iterable[OutEvent]) -> bytes:
        events = list(events)
        self._trace._take(events)
        return self._inner.encode(events)


class _CapturingFolder:
    """A folder that also keeps the output text for the span (capture_content)."""

    __slots__ = ("_inner", "_trace")

    def __init__(self, inner: Folder, trace: RequestTrace) -> None:
        self._inner = inner
        self._trace = trace

    @property
    def error(self) -> ErrorOut | None:
        return self._inner.error

    def add(self, events: Iterable[OutEvent]) -> None:
        events = list(events)
        self._trace._take(events)
        self._inner.add(events)

    def body(self) -> dict[str, Any]:
        return self._inner.body()
