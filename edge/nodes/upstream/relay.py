"""One run served by an OpenAI-compatible upstream: a streaming POST whose events go out
as RunEvents, exactly one of them terminal.

Loop-agnostic (anyio and httpcore): iop-node relays its runs on asyncio
(`edge.nodes.upstream.server`), and the edge relays the runs of its
`openai+http://` nodes on trio, in the run's own task (`edge.nodes.direct`).
Both send the same body, read the same events and end the same way.

A relay given a forwarding policy (`iop-node`'s) applies it to each run's body before
anything is sent (`edge.nodes.upstream.admit`): a run it refuses ends with an error
event of `http_status` 400, a refusal the edge does not try elsewhere. The edge's own
`openai+http://` nodes have none: the edge applied the model's policy already.

Ending a run early (its task cancelled, the request's deadline) leaves the
HTTP stream's block, which closes the upstream connection at once: vLLM,
llama.cpp, Ollama and SGLang abort a request whose client went away.
"""

from __future__ import annotations

import codecs
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import httpcore
import msgspec
from loguru import logger
from opentelemetry.trace import Span

from edge.contract._proto.iop.node import v1 as pb
from edge.errors import RequestError
from edge.forwarding import ForwardPolicy
from edge.nodes.kit import NodeSpans
from edge.nodes.upstream.admit import admit
from edge.nodes.upstream.bodies import upstream_error
from edge.nodes.upstream.chunks import ChunkMapper, coalesced
from edge.nodes.upstream.continuation import (
    LLAMACPP_MODE,
    NONE,
    as_failure,
    continued_body,
    whole_usage,
)
from edge.nodes.upstream.request import chat_request_body
from edge.nodes.upstream.sse import SSEDecoder
from edge.observe.tracing import inject, set_error

CONNECT_TIMEOUT_S = 10.0
# After the terminal event, read the rest of the body (to reuse the connection) this long.
DRAIN_TIMEOUT_S = 1.0
# An error answer's body is read up to this many bytes (then the request is closed):
# room for any server's error object, a validation error's list of fields included;
# what is quoted of it is bounded again (`edge.nodes.upstream.bodies.MAX_ERROR_CHARS`).
MAX_ERROR_BODY = 16 * 1024
# A whole (non-streamed) answer is read up to this many bytes; past it the run
# ends with an error event and the upstream request is closed.
MAX_BODY_BYTES = 16 * 1024 * 1024
# Past this many characters (or bytes) an event, or a whole answer, is parsed in a worker
# thread: the edge relays its `openai+http://` nodes' runs on its own loop, where a parse
# that grows with what a server sent must not run in one step.
OFFLOAD_CHARS = 64 * 1024

# What llama.cpp's server is asked for a run with stop sequences: its streamed chat answer
# does not name the one that matched, unless asked for its own fields, which it then puts
# on its last chunk as `__verbose` (`stop_type`, `stopping_word`: only those two).
LLAMACPP_STOP = {"verbose": True, "response_fields": ["stop_type", "stopping_word"]}

Emit = Callable[[pb.RunEvent], Awaitable[None]]
# The RunEvent types that end a run.
TERMINAL = frozenset({"complete", "error", "cancelled"})


# The failures of a request whose connection broke, once made (httpcore's own types).
_BROKEN = (httpcore.NetworkError, httpcore.ProtocolError)


class Refused(ValueError):
    """A run the forwarding policy refuses: the request's fault, a 400 (its error
    event's `http_status`), whose words name the field."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.message = error.message
        self.code = error.code or "invalid_value"


class Relay:
    """The runs of one upstream, on a connection pool of their own (httpcore: the
    transport under httpx, without its client's per-request work: cookies, redirects,
    auth flows, URL and charset parsing). Keep-alive, no limit on connections: the
    edge bounds the runs.

    Args:
        upstream: the API base URL, e.g. `http://127.0.0.1:8000/v1`.
        name: the node's name, for its log lines.
        continuation_mode: how a model's answers are continued
            (`edge.nodes.upstream.continuation`), asked when a run continues one.
        llamacpp: whether a model is served by llama.cpp's server, asked when a run
            has stop sequences (`LLAMACPP_STOP`).
        spans: the node's spans (None: tracing off).
        api_key: sent as `Authorization: Bearer ...` when set.
        read_timeout_s: the longest silence tolerated from the upstream.
        policy: what a run may send the upstream (`edge.nodes.upstream.admit`);
            None: runs are sent as they come (the edge's own nodes, after its policy).
        prepare: awaited with each run and its upstream body before the body is sent
            (within the run's deadline): iop-node's KV index registers the prompt
            (`edge.nodes.upstream.kvfeed`); None: nothing.
    """

    def __init__(
        self,
        upstream: str,
        *,
        name: str,
        continuation_mode: Callable[[str], str],
        llamacpp: Callable[[str], bool] = lambda model: False,
        spans: NodeSpans | None = None,
        api_key: str | None = None,
        read_timeout_s: float = 600.0,
        policy: ForwardPolicy | None = None,
        prepare: Callable[[pb.RunRequest, bytes], Awaitable[None]] | None = None,
    ) -> None:
        self.chat_url = upstream + "/chat/completions"
        self.name = name
        self.continuation_mode = continuation_mode
        self.llamacpp = llamacpp
        self.spans = spans
        self.policy = policy
        self.prepare = prepare
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=None, max_keepalive_connections=64, keepalive_expiry=5.0
        )
        self._headers = [
            (b"Content-Type", b"application/json"), (b"Accept", b"text/event-stream"),
        ]  # fmt: skip
        if api_key:
            self._headers.append((b"Authorization", f"Bearer {api_key}".encode()))
        self._timeouts = {
            "connect": CONNECT_TIMEOUT_S, "read": read_timeout_s, "write": CONNECT_TIMEOUT_S,
            "pool": None,
        }  # fmt: skip

    async def aclose(self) -> None:
        """Close the connections (runs still working see them break)."""
        await self._pool.aclose()

    def body(self, request: pb.RunRequest) -> bytes | ValueError:
        """The upstream request's body for `request`, or the error that says why the run
        cannot be served (the run's error event; `Refused`: the policy's 400). Work
        that grows with the request: a caller on a loop runs it where it may, and gives
        `run` the result."""
        try:
            body = chat_request_body(request)
        except ValueError as exc:
            return ValueError(f"invalid run request: {exc}")
        if self.policy is not None:
            try:
                admitted = admit(body, self.policy)
            except RequestError as exc:
                logger.info("{}: run {} refused: {}", self.name, request.run_id, exc.message)
                return Refused(exc)
            if admitted.dropped:
                logger.debug(
                    "{}: run {} sent without {}",
                    self.name, request.run_id, ", ".join(admitted.dropped),
                )  # fmt: skip
            body = admitted.body
        if request.stop and self.llamacpp(request.model):
            body |= LLAMACPP_STOP
        held = request.continuation
        if held is not None:
            mode = self.continuation_mode(request.model)
            if mode == NONE:
                return ValueError(f"this node does not continue answers of model {request.model!r}")
            if mode == LLAMACPP_MODE and held.reasoning:
                logger.info(
                    "{}: run {} continues on llama.cpp without its reasoning ({} characters):"
                    " the server prefills the answer's text only",
                    self.name, request.run_id, len(held.reasoning),
                )  # fmt: skip
            body = continued_body(body, held, mode)
        return msgspec.json.encode(body)

    async def run(
        self,
        request: pb.RunRequest,
        emit: Emit,
        span: Span | None = None,
        *,
        body: bytes | ValueError | None = None,
        deadline_unix_ms: int | None = None,
    ) -> None:
        """Serve `request` from the upstream, emitting its events and exactly one terminal
        (unless cancelled first). `span`: the run's, for the upstream request's child;
        `body`: `self.body(request)`, made already; `deadline_unix_ms`: the run's
        deadline, where `request` does not hold it."""
        mapper = ChunkMapper(id_prefix=request.run_id)
        if body is None:
            body = self.body(request)
        if isinstance(body, Refused):
            await emit(mapper.error(body.code, message=body.message, http_status=400))
            return
        if isinstance(body, ValueError):
            await emit(mapper.error(str(body)))
            return
        if request.continuation is not None:
            emit = _continuing(emit, request.continuation)
        if deadline_unix_ms is None:
            deadline_unix_ms = request.deadline_unix_ms
        remaining = math.inf
        if deadline_unix_ms > 0:
            remaining = max(0.0, deadline_unix_ms / 1000 - time.time())
        with anyio.move_on_after(remaining) as deadline:
            if self.prepare is not None:
                await self.prepare(request, body)
            await self._traced(body, request.model, mapper, emit, span)
        if deadline.cancelled_caught and not mapper.terminated:
            await emit(pb.RunEvent(type="cancelled", error="run deadline exceeded"))

    async def _traced(
        self, body: bytes, model: str, mapper: ChunkMapper, emit: Emit, run_span: Span | None
    ) -> None:
        """`_stream`, in a CLIENT span when the run has one (tracing on)."""
        if run_span is None or self.spans is None:
            await self._stream(body, mapper, emit)
            return
        span = self.spans.client_span(run_span, model, self.chat_url)
        try:
            await self._stream(body, mapper, emit, span)
        except BaseException as exc:
            set_error(span, type(exc).__name__)
            raise
        else:
            if mapper.outcome == "error":
                set_error(span, "upstream_error")
        finally:
            span.end()

    async def _stream(
        self, body: bytes, mapper: ChunkMapper, emit: Emit, span: Span | None = None
    ) -> None:
        """One streaming POST; every HTTP failure becomes the terminal error event (an
        error status: a refusal, an overload or a failure, as `upstream_error` says)."""
        url = self.chat_url
        headers = self._headers
        if span is not None:  # the upstream continues the trace
            headers = headers + [(k.encode(), v.encode()) for k, v in inject(span).items()]
        try:
            async with self._pool.stream(
                "POST", url, headers=headers, content=body,
                extensions={"timeout": self._timeouts},
            ) as response:  # fmt: skip
                status = response.status
                if span is not None:
                    span.set_attribute("http.response.status_code", status)
                chunks = response.aiter_stream()
                if status >= 400:
                    raw = await _read_capped(chunks)
                    reason = response.extensions.get("reason_phrase", b"")
                    failure = upstream_error(status, raw, reason.decode("latin-1"))
                    await emit(mapper.error(failure.error, message=failure.message,
                                            http_status=failure.http_status))  # fmt: skip
                    return
                content_type = _header(response.headers, b"content-type")
                if not content_type or "event-stream" in content_type:
                    await self._relay_sse(chunks, mapper, emit)
                elif "json" in content_type:  # a server that does not stream
                    raw = await _read_capped(chunks, MAX_BODY_BYTES + 1)
                    if len(raw) > MAX_BODY_BYTES:
                        text = f"upstream answer exceeds the node's limit of {MAX_BODY_BYTES} bytes"
                        await emit(mapper.error(text))
                        return
                    if len(raw) > OFFLOAD_CHARS:
                        events = await anyio.to_thread.run_sync(_whole, mapper, raw)
                    else:
                        events = _whole(mapper, raw)
                    for event in events:
                        await emit(event)
                else:
                    raw = await _read_capped(chunks)
                    quoted = raw[:200].decode("utf-8", errors="replace")
                    text = f"upstream answered {content_type}, not an event stream: {quoted!r}"
                    await emit(mapper.error(text))
        except httpcore.ConnectError as exc:
            await emit(mapper.error(f"cannot connect to upstream {url}: {exc_reason(exc)}"))
        except httpcore.TimeoutException as exc:
            if not mapper.terminated:
                await emit(mapper.error(f"upstream {url} timed out: {exc_reason(exc)}"))
        except _BROKEN as exc:
            if not mapper.terminated:
                await emit(mapper.error(f"upstream stream ended early: {exc_reason(exc)}"))
        except ValueError as exc:  # a body that is not JSON, or an endless line
            if not mapper.terminated:
                await emit(mapper.error(f"upstream sent a malformed body: {exc_reason(exc)}"))

    async def _relay_sse(
        self, chunks: AsyncIterator[bytes], mapper: ChunkMapper, emit: Emit
    ) -> None:
        """The events of an event stream, read by read. Leaving before its end (an error,
        a limit, cancellation) closes the connection: the upstream's abort signal."""
        decoder = SSEDecoder()
        # UTF-8 (an event stream's only encoding), a character split between reads kept.
        text_of = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        async for chunk in chunks:
            # What one read brought goes out with its text deltas joined (`coalesced`);
            # a malformed event ends the run after the events before it. A read that
            # completes a large event (its parse grows with it) is parsed in a thread.
            text = text_of(chunk)
            if decoder.pending_chars + len(text) > OFFLOAD_CHARS:
                events, error = await anyio.to_thread.run_sync(_events, decoder, mapper, text)
            else:
                events, error = _events(decoder, mapper, text)
            for event in coalesced(events):
                await emit(event)
            if error is not None:
                raise error
            if mapper.terminated:
                break
        else:
            for message in decoder.feed(text_of(b"", True)):
                for event in mapper.feed(message):
                    await emit(event)
            for message in decoder.close():
                for event in mapper.feed(message):
                    await emit(event)
            for event in mapper.end():
                await emit(event)
            return
        if mapper.outcome != "error":
            # The body ends right after [DONE]: read it, so the connection is reused.
            with anyio.move_on_after(DRAIN_TIMEOUT_S):
                try:
                    async for _ in chunks:
                        pass
                except (*_BROKEN, httpcore.TimeoutException):
                    pass


def _events(
    decoder: SSEDecoder, mapper: ChunkMapper, text: str
) -> tuple[list[pb.RunEvent], ValueError | None]:
    """The events one read's `text` makes, and the error that cut them short (a malformed
    event, an endless line), if any."""
    events: list[pb.RunEvent] = []
    try:
        for message in decoder.feed(text):
            events += mapper.feed(message)
    except ValueError as exc:
        return events, exc
    return events, None


def _whole(mapper: ChunkMapper, raw: bytes) -> list[pb.RunEvent]:
    """The events of a whole (non-streamed) answer. ValueError: not JSON."""
    return list(mapper.feed_completion(json.loads(raw)))


def _continuing(emit: Emit, held: pb.Continuation) -> Emit:
    """`emit` for a run that continues `held`: the whole answer's usage, and a refusal of
    the upstream's the node's failure (`edge.nodes.upstream.continuation`)."""

    async def out(event: pb.RunEvent) -> None:
        await emit(as_failure(whole_usage(event, held)))

    return out


def exc_reason(exc: BaseException) -> str:
    """An exception's words, else its type's name (an HTTP error's often has none)."""
    return str(exc) or type(exc).__name__


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    """The first value of header `name` (lower case), "" when absent."""
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


async def _read_capped(chunks: AsyncIterator[bytes], limit: int = MAX_ERROR_BODY) -> bytes:
    """At most `limit` bytes of a body (an error body: enough to quote), never unbounded."""
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        parts.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)[:limit]
