"""POST /v1/chat/completions: parse, open the run, render its output.

The handler only parses and renders: the run's life (node, slot, accept,
deadlines, CancelRun, outcome) is `edge.run.Run`'s, the same for both
answers. A streaming answer's run is held by the request's scope
(`edge.http.scope.ChatScope`), which ends it when the request's HTTP cycle
ends, however it ends: the body finished, the client left (even before
quart began the body), or the connection was cut. A non-streaming answer's
run is entered and left in the handler itself. The status is chosen before
any byte: the handler returns only once the node accepted the run.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import TracebackType
from typing import Any

import msgspec
import trio
from loguru import logger
from quart import Response
from quart.wrappers.response import ResponseBody

from edge.api.policy import apply_policy
from edge.api.render import KEEPALIVE, ResponseBuilder, SSEEncoder
from edge.api.request import ChatRequest, parse_chat_request
from edge.config import Config
from edge.errors import error_object, status_of
from edge.http.scope import ChatScope
from edge.metrics import EdgeMetrics
from edge.node.pool import NodePool
from edge.run import OutcomeHook, Run, Runs
from edge.stream.session import SessionSettings, StreamSession
from edge.stream.toolcheck import tool_validation_mode

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

SHUTDOWN_NOTICE = "the edge is shutting down; retry the request"


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
        metrics: EdgeMetrics,
        on_outcome: OutcomeHook | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.on_outcome = on_outcome
        self.runs = Runs(pool, config.timeouts, metrics)
        # Request parsing runs in worker threads (schema checks cost ms per KiB);
        # few at once, so the loop thread waits little for the GIL.
        self.parsing = trio.CapacityLimiter(PARSE_THREADS)

    def settings_for(self, request: ChatRequest, run_id: str) -> SessionSettings:
        model = self.config.model(request.model)
        strict = model.strict if request.strict_output is None else request.strict_output
        buffered = model.stream_buffer if request.stream_buffer is None else request.stream_buffer
        validation = tool_validation_mode(
            request.tool_validation,
            model.tool_validation,
            request_strict_output=request.strict_output,
            model_strict=model.strict,
        )
        return SessionSettings(
            run_id=run_id,
            strict=strict,
            stream_buffer=buffered,
            include_reasoning=request.include_reasoning,
            reasoning_explicit=request.reasoning_explicit,
            trace=request.trace_stream or model.trace_stream,
            tools=replace(
                request.tools,
                validation=validation,
                strict_tools=request.tool_validation is None,
            ),
            tool_formats=model.tool_call_formats,
            sentinels=model.sentinels,
            reasoning_parser=model.reasoning_parser,  # type: ignore[arg-type]
            response_format=request.response_format,
            whole_output=not request.stream,
            logprobs=request.logprobs,
        )

    def forwarded(self, request: ChatRequest) -> ChatRequest:
        """The request as its model's forwarding policy lets it reach the node."""
        result = apply_policy(request, self.config.model(request.model).forward_policy)
        if result.dropped:
            logger.bind(model=request.model).debug(
                "not forwarded to the node: {}", ", ".join(result.dropped)
            )
        return result.request

    async def handle(self, body: bytes, scope: ChatScope) -> Response:
        """Answer one chat request; errors before the first byte raise an EdgeError."""
        # Schema checks of declared tools cost milliseconds per KiB: off the
        # loop, so a large request never stalls other streams.
        request = await trio.to_thread.run_sync(parse_chat_request, body, limiter=self.parsing)
        scope.stream = request.stream
        if request.model in self.pool.models():  # metric labels: only models nodes serve
            scope.model = request.model
        request = self.forwarded(request)
        run_id = secrets.token_hex(12)
        settings = self.settings_for(request, run_id)
        session = StreamSession(settings, _trace if settings.trace else None)
        keepalive_s = self.config.server.keepalive_s if request.stream else 0.0
        run = self.runs.open(
            scope.nursery, request, session, request_id=scope.request_id,
            keepalive_s=keepalive_s, on_end=scope.finish,
        )  # fmt: skip
        scope.run = run
        created = int(time.time())
        response_id = f"chatcmpl-{run_id}"
        if not request.stream:
            async with run:
                return await _complete(
                    run, response_id, created, scope.request_id, logprobs=request.logprobs
                )
        await scope.hold(run)
        encoder = SSEEncoder(response_id, created, request.model,
                             include_usage=request.include_usage)  # fmt: skip
        labels = self.metrics.inter_chunk.labels(request.model, run.info.node)
        sse = SSEBody(run, encoder, observe_gap=labels.observe,
                      observe_added=self.metrics.added_latency.observe)  # fmt: skip
        response = Response(sse, status=200, headers=SSE_HEADERS)
        response.headers["X-Request-Id"] = scope.request_id
        return response

    def shutdown_streams(self) -> int:
        """Drain deadline: end every run still in flight, with a notice. Returns how many."""
        return self.runs.shut_down(SHUTDOWN_NOTICE)


async def _complete(
    run: Run, response_id: str, created: int, request_id: str, *, logprobs: bool = False
) -> Response:
    """The non-streaming answer: the run's whole output folded into one JSON body."""
    builder = ResponseBuilder(logprobs=logprobs)
    session = run.session
    while not session.terminated:
        batch = await run.next_batch()
        if batch != "keepalive":
            builder.add(batch)
    builder.add(session.drain())
    if builder.error is not None:
        status = status_of(builder.error.type)
        body = error_object(builder.error.type, builder.error.message)
    else:
        status = 200
        body = builder.response(response_id, created, run.info.model)
    response = Response(msgspec.json.encode(body), status=status,
                        content_type="application/json")  # fmt: skip
    response.headers["X-Request-Id"] = request_id
    return response


class SSEBody(ResponseBody):
    """The body of a streaming answer: one run's SSE frames, ready ones in one write.

    The writer. Its end ends the run; the request's scope ends it too, for a
    body quart never began (the client left while the head went out).
    """

    def __init__(
        self,
        run: Run,
        encoder: SSEEncoder,
        *,
        observe_gap: Callable[[float], None],
        observe_added: Callable[[float], None],
    ) -> None:
        self._run = run
        self._encoder = encoder
        self._observe_gap = observe_gap
        self._observe_added = observe_added
        self._last_write: float | None = None

    async def __aenter__(self) -> SSEBody:
        return self

    def __aiter__(self) -> SSEBody:
        return self

    async def __anext__(self) -> bytes:
        run = self._run
        while True:
            batch = await run.next_batch()
            if batch == "keepalive":
                return KEEPALIVE
            if not batch:
                # Nothing to write: a filter held the text back, or (the session
                # terminated) everything was taken.
                if run.session.terminated:
                    raise StopAsyncIteration
                continue
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
        # Ended here, the outcome is counted before quart sends the last byte.
        await self._run.end()
