"""POST /v1/chat/completions: validate, pick a node, start the run, answer.

Streaming answers are an `SSEBody`: quart iterates it inside `async with`,
so its `__aexit__` is the one place a client disconnect is seen; it calls
`RunStream.abandon()`, which cancels the run on the node through the one
cancel path. Non-streaming answers are folded in the handler itself, whose
cancellation (client gone) reaches the same `abandon()` in a `finally`.
Every request that reaches the handler is counted once: `_finished` for a
run that started, `metrics.rejected` for one that did not (the app counts
those answered before the handler).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import msgspec
import trio
from loguru import logger
from quart import Response
from quart.wrappers.response import ResponseBody

from edge.api.policy import apply_policy
from edge.api.render import KEEPALIVE, ResponseBuilder, SSEEncoder, error_body
from edge.api.request import ChatRequest, parse_chat_request
from edge.config import Config
from edge.errors import EdgeError, NodeUnavailableError
from edge.http.runstream import RunStream
from edge.metrics import EdgeMetrics
from edge.node.client import RunHandle
from edge.node.pool import NodePool, NodeState
from edge.node.wire import encode_run_request
from edge.stream.output import Outcome, Status
from edge.stream.session import SessionSettings, StreamSession

# Non-streaming error statuses by error type (streams carry the type in the frame).
_ERROR_STATUS = {
    "tool_validation_error": 422,
    "output_validation_error": 422,
    "timeout": 504,
    "service_unavailable": 503,
    "node_unavailable": 503,
}

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

SHUTDOWN_NOTICE = "the edge is shutting down; retry the request"

OutcomeHook = Callable[["StreamInfo", Outcome], None]


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """What metrics and logs need to know of a finished stream."""

    run_id: str
    model: str
    node: str
    stream: bool
    started_at: float
    request_id: str = ""


def _trace(what: str, fields: Mapping[str, Any]) -> None:
    logger.bind(**fields).info("stream trace: {}", what)


# Requests parsed at once, each in a worker thread.
PARSE_THREADS = 4


class ChatService:
    """The chat completions endpoint's state: config, nodes, runs, metrics."""

    def __init__(
        self,
        config: Config,
        pool: NodePool,
        runs: trio.Nursery,
        metrics: EdgeMetrics,
        on_outcome: OutcomeHook | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.runs = runs
        self.metrics = metrics
        self.on_outcome = on_outcome
        # Streams in flight in this process, for drain; not shared state.
        self.active: set[RunStream] = set()
        # Request parsing runs in worker threads (schema checks cost ms per KiB);
        # few at once, so the loop thread waits little for the GIL.
        self.parsing = trio.CapacityLimiter(PARSE_THREADS)

    def settings_for(self, request: ChatRequest, run_id: str) -> SessionSettings:
        model = self.config.model(request.model)
        strict = model.strict if request.strict_output is None else request.strict_output
        buffered = model.stream_buffer if request.stream_buffer is None else request.stream_buffer
        return SessionSettings(
            run_id=run_id,
            strict=strict,
            stream_buffer=buffered,
            include_reasoning=request.include_reasoning,
            reasoning_explicit=request.reasoning_explicit,
            trace=request.trace_stream or model.trace_stream,
            tools=request.tools,
            tool_formats=model.tool_call_formats,
            sentinels=model.sentinels,
            reasoning_parser=model.reasoning_parser,  # type: ignore[arg-type]
            response_format=request.response_format,
            whole_output=not request.stream,
        )

    def forwarded(self, request: ChatRequest) -> ChatRequest:
        """The request as its model's forwarding policy lets it reach the node."""
        result = apply_policy(request, self.config.model(request.model).forward_policy)
        if result.dropped:
            logger.bind(model=request.model).debug(
                "not forwarded to the node: {}", ", ".join(result.dropped)
            )
        return result.request

    async def handle(self, body: bytes, request_id: str = "") -> Response:
        try:
            # Schema checks of declared tools cost milliseconds per KiB: off the
            # loop, so a large request never stalls other streams.
            request = await trio.to_thread.run_sync(parse_chat_request, body, limiter=self.parsing)
        except EdgeError:
            self.metrics.rejected("unknown", stream=False)
            raise
        try:
            node = self.pool.pick(request.model)
        except EdgeError:
            known = request.model in self.pool.models()
            self.metrics.rejected(request.model if known else "unknown", request.stream)
            raise
        try:
            request = self.forwarded(request)
        except EdgeError:
            self.metrics.rejected(request.model, request.stream)
            raise
        run_id = secrets.token_hex(12)
        created = int(time.time())
        settings = self.settings_for(request, run_id)
        started_at = trio.current_time()
        info = StreamInfo(
            run_id, request.model, node.client.name, request.stream, started_at, request_id
        )
        handle = await self._start_run(node, request, info)
        self.metrics.counted_at_its_end()
        session = StreamSession(settings, _trace if settings.trace else None)
        run = RunStream(
            handle,
            session,
            self.config.timeouts,
            started_at=started_at,
            keepalive_s=self.config.server.keepalive_s if request.stream else 0.0,
        )
        self.active.add(run)
        self.metrics.active_streams.inc()
        response_id = f"chatcmpl-{run_id}"
        if request.stream:
            encoder = SSEEncoder(
                response_id, created, request.model, include_usage=request.include_usage
            )
            labels = self.metrics.inter_chunk.labels(request.model, node.client.name)
            sse = SSEBody(
                run,
                encoder,
                lambda outcome: self._finished(node, run, info, outcome),
                observe_gap=labels.observe,
                observe_added=self.metrics.added_latency.observe,
            )
            response = Response(sse, status=200, headers=SSE_HEADERS)
            response.headers["X-Request-Id"] = request_id
            return response
        return await self._complete(node, run, info, response_id, created, request.model)

    async def _start_run(
        self, node: NodeState, request: ChatRequest, info: StreamInfo
    ) -> RunHandle:
        """Start the run on `node`; every way it can fail to start is counted and logged once."""
        total_s = self.config.timeouts.total_s
        run_request = encode_run_request(
            request,
            run_id=info.run_id,
            model=request.model,
            deadline_unix_ms=int((time.time() + total_s) * 1000),
        )
        node.in_flight += 1
        try:
            return await node.client.start_run(
                self.runs,
                run_request,
                deadline=info.started_at + total_s,
                slow_consumer_s=self.config.timeouts.slow_client_s,
                accept_s=self.config.timeouts.first_event_s,
            )
        except EdgeError as exc:
            node.in_flight -= 1
            if isinstance(exc, NodeUnavailableError):
                self.pool.mark_down(node, exc.message)
            self.metrics.rejected(request.model, request.stream)
            self.metrics.node_errors.labels(node.client.name, exc.type).inc()
            # The run id ties this rejection to the node's own record of the run.
            logger.bind(
                request_id=info.request_id, run_id=info.run_id, node=node.client.name,
                error_type=exc.type,
            ).warning("run {} did not start on node {}: {}", info.run_id, node.client.name,
                      exc.message)  # fmt: skip
            if self.on_outcome is not None:
                self.on_outcome(info, Outcome("error", error_type=exc.type, usage_sample=False))
            raise
        except BaseException as exc:
            node.in_flight -= 1
            # The caller left (or the edge is stopping) before the node accepted
            # the run; start_run has cancelled it. Still one count, one log line.
            status: Status = "error" if isinstance(exc, Exception) else "cancelled"
            self._log_outcome(info, Outcome(status, usage_sample=False))
            raise

    async def _complete(
        self,
        node: NodeState,
        run: RunStream,
        info: StreamInfo,
        response_id: str,
        created: int,
        model: str,
    ) -> Response:
        builder = ResponseBuilder()
        try:
            while not run.session.terminated:
                batch = await run.next_batch()
                if batch != "keepalive":
                    builder.add(batch)
            builder.add(run.session.drain())
        finally:
            run.abandon()
            assert run.session.outcome is not None
            self._finished(node, run, info, run.session.outcome)
        if builder.error is not None:
            status = _ERROR_STATUS.get(builder.error.type, 502)
            body = error_body(builder.error.type, builder.error.message)
        else:
            status = 200
            body = builder.response(response_id, created, model)
        response = Response(msgspec.json.encode(body), status=status,
                            content_type="application/json")  # fmt: skip
        response.headers["X-Request-Id"] = info.request_id
        return response

    def _finished(
        self, node: NodeState, run: RunStream, info: StreamInfo, outcome: Outcome
    ) -> None:
        node.in_flight -= 1
        self.active.discard(run)
        metrics = self.metrics
        metrics.active_streams.dec()
        if run.first_event_at is not None:
            metrics.ttft.labels(info.model, info.node).observe(run.first_event_at - info.started_at)
        if outcome.status == "error" and not outcome.usage_sample:
            metrics.node_errors.labels(info.node, "stream_broken").inc()
        self._log_outcome(info, outcome)
        if run.session.settings.trace:
            logger.bind(**run.session.log_fields()).info("stream closed")
        if self.on_outcome is not None:
            self.on_outcome(info, outcome)

    def _log_outcome(self, info: StreamInfo, outcome: Outcome) -> None:
        """Count a request that ran (or began to) and log its one "chat completion" line."""
        self.metrics.request(info.model, info.node, info.stream, outcome)
        duration = trio.current_time() - info.started_at
        logger.bind(
            request_id=info.request_id, run_id=info.run_id, model=info.model, node=info.node,
            stream=info.stream, status=outcome.status, finish_reason=outcome.finish_reason,
            error_type=outcome.error_type, duration_ms=round(duration * 1000, 2),
        ).info("chat completion {}", outcome.status)  # fmt: skip

    def shutdown_streams(self) -> int:
        """Drain deadline: end every stream still in flight, with a notice. Returns how many."""
        streams = list(self.active)
        for run in streams:
            run.shutdown(SHUTDOWN_NOTICE)
        return len(streams)


class SSEBody(ResponseBody):
    """The body of a streaming answer: one run's SSE frames, ready ones in one write."""

    def __init__(
        self,
        run: RunStream,
        encoder: SSEEncoder,
        on_done: Callable[[Outcome], None],
        *,
        observe_gap: Callable[[float], None],
        observe_added: Callable[[float], None],
    ) -> None:
        self._run = run
        self._encoder = encoder
        self._on_done: Callable[[Outcome], None] | None = on_done
        self._observe_gap = observe_gap
        self._observe_added = observe_added
        self._last_write: float | None = None

    async def __aenter__(self) -> SSEBody:
        return self

    def __aiter__(self) -> SSEBody:
        return self

    async def __anext__(self) -> bytes:
        run = self._run
        session = run.session
        while True:
            if session.terminated and not session.out:
                raise StopAsyncIteration
            batch = await run.next_batch()
            if batch == "keepalive":
                return KEEPALIVE
            if batch:
                data = self._encoder.encode(batch)
                now = trio.current_time()
                if run.batch_event_at is not None:  # the edge's share of a node event's trip
                    self._observe_added(now - run.batch_event_at)
                if self._last_write is not None:
                    self._observe_gap(now - self._last_write)
                self._last_write = now
                return data

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close()

    def _close(self) -> None:
        on_done, self._on_done = self._on_done, None
        if on_done is None:
            return
        self._run.abandon()
        assert self._run.session.outcome is not None
        on_done(self._run.session.outcome)

    def __del__(self) -> None:
        # Safety net: a response dropped before quart began its body (the
        # client left while the headers were sent) still ends its run.
        if self._on_done is not None:
            self._close()
