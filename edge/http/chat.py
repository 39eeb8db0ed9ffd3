"""POST /v1/chat/completions: validate, pick a node, start the run, answer.

Streaming answers are an `SSEBody`: quart iterates it inside `async with`,
so its `__aexit__` is the one place a client disconnect is seen; it calls
`RunStream.abandon()`, which cancels the run on the node through the one
cancel path. Non-streaming answers are folded in the handler itself, whose
cancellation (client gone) reaches the same `abandon()` in a `finally`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import trio
from loguru import logger
from quart import Response
from quart.wrappers.response import ResponseBody

from edge.api.render import KEEPALIVE, ResponseBuilder, SSEEncoder, error_body
from edge.api.request import ChatRequest, parse_chat_request
from edge.config import Config
from edge.errors import EdgeError
from edge.http.runstream import RunStream
from edge.node.convert import run_request_from_chat
from edge.node.pool import NodePool, NodeState
from edge.stream.output import Outcome
from edge.stream.session import SessionSettings, StreamSession

# Non-streaming error statuses by error type.
_ERROR_STATUS = {
    "tool_validation_error": 422,
    "output_validation_error": 422,
    "timeout": 504,
}

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

OutcomeHook = Callable[["StreamInfo", Outcome], None]


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """What metrics and logs need to know of a finished stream."""

    run_id: str
    model: str
    node: str
    stream: bool
    started_at: float
    first_event_at: float | None


def _trace(what: str, fields: Mapping[str, Any]) -> None:
    logger.bind(**fields).info("stream trace: {}", what)


class ChatService:
    """The chat completions endpoint's state: config, nodes, and the runs nursery."""

    def __init__(
        self,
        config: Config,
        pool: NodePool,
        runs: trio.Nursery,
        on_outcome: OutcomeHook | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.runs = runs
        self.on_outcome = on_outcome

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
        )

    async def handle(self, body: bytes) -> Response:
        request = parse_chat_request(body)
        node = self.pool.pick(request.model)
        run_id = secrets.token_hex(12)
        created = int(time.time())
        settings = self.settings_for(request, run_id)
        started_at = trio.current_time()
        deadline = started_at + self.config.timeouts.total_s
        run_request = run_request_from_chat(
            request,
            run_id=run_id,
            model=request.model,
            deadline_unix_ms=int((time.time() + self.config.timeouts.total_s) * 1000),
        )
        node.in_flight += 1
        try:
            handle = await node.client.start_run(self.runs, run_request, deadline=deadline)
        except BaseException:
            node.in_flight -= 1
            raise
        session = StreamSession(settings, _trace if settings.trace else None)
        run = RunStream(
            handle,
            session,
            self.config.timeouts,
            started_at=started_at,
            keepalive_s=self.config.server.keepalive_s if request.stream else 0.0,
        )
        info = StreamInfo(run_id, request.model, node.client.name, request.stream, started_at, None)
        response_id = f"chatcmpl-{run_id}"
        if request.stream:
            encoder = SSEEncoder(
                response_id, created, request.model, include_usage=request.include_usage
            )
            body_ = SSEBody(run, encoder, lambda outcome: self._finished(node, run, info, outcome))
            return Response(body_, status=200, headers=SSE_HEADERS)
        return await self._complete(node, run, info, response_id, created, request.model)

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
            return Response(
                _json(error_body(builder.error.type, builder.error.message)),
                status=status,
                content_type="application/json",
            )
        return Response(
            _json(builder.response(response_id, created, model)),
            status=200,
            content_type="application/json",
        )

    def _finished(
        self, node: NodeState, run: RunStream, info: StreamInfo, outcome: Outcome
    ) -> None:
        node.in_flight -= 1
        if self.on_outcome is not None:
            final = StreamInfo(
                info.run_id, info.model, info.node, info.stream, info.started_at, run.first_event_at
            )
            self.on_outcome(final, outcome)


def _json(value: object) -> bytes:
    import msgspec

    return msgspec.json.encode(value)


class SSEBody(ResponseBody):
    """The body of a streaming answer: one run's SSE frames, ready ones in one write."""

    def __init__(
        self, run: RunStream, encoder: SSEEncoder, on_done: Callable[[Outcome], None]
    ) -> None:
        self._run = run
        self._encoder = encoder
        self._on_done: Callable[[Outcome], None] | None = on_done
        self._entered = False

    async def __aenter__(self) -> SSEBody:
        self._entered = True
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
                return self._encoder.encode(batch)

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


def edge_error_response(error: EdgeError) -> Response:
    return Response(_json(error.to_dict()), status=error.status, content_type="application/json")
