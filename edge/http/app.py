"""The quart-trio application: routes, API keys, and errors rendered OpenAI's way.

Every error a caller can see leaves through `_error_response`: an EdgeError
as its status and OpenAI error object, an HTTP error (404, 405, 413) the
same way, and anything unexpected as a logged 500 with no traceback in the
body. Quart's 60 s response timeout is off: the edge owns its deadlines.

Paths are matched as sent: a target that is not byte for byte one of the
edge's routes (`//`, a trailing slash, percent-encoding, `..`, an absolute
URL) is the JSON 404, never a redirect (werkzeug would otherwise answer
`//` with a 308 whose Location is built from the Host header).

The four APIs (`/v1/chat/completions`, `/v1/responses`, `/v1/messages`,
`/v1/completions`) are one handler (`edge.http.chat`); the endpoints that start
no run (`/v1/models`, `/v1/models/{id}`, `/v1/messages/count_tokens`) are
`edge.http.endpoints`'. An error under `/v1/messages`, whatever raised it
(an unknown path there, a 405, a missing key), is rendered in Anthropic's
shape instead, as is one of an Anthropic client's `/v1/models` request
(`edge.http.endpoints.error_api`).

CORS (`edge.http.cors`): a preflight from an allowed origin is answered in
`before`, after the path guard and before the API key is asked for; every
answer to an allowed origin carries its headers (`after`).

API keys: the request's `KeyRing` (edge.limits.limiter; the keys of the
configuration it arrived under, `edge.http.live`) tells which key a `/v1/` request
holds, sent as `Authorization: Bearer <key>` or (Anthropic's way) `x-api-key`.
The other requests that read a body or stored items (count_tokens, a stored
response, its input items) are admitted the same way, in their handler, before
either (`edge.http.endpoints.admitted`). A chat request's `Gate` (its key's
allow-list and limits) is opened
with its HTTP cycle, admits it in the handler before its body is read (a
key over its limits is answered 429 without its body being parsed), checks
its model once parsed (its stream lease is renewed by the limiter while it
lives), puts the rate-limit headers on whatever answer goes out, and
is ended once: with its run, else when the cycle ends, however it ends.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import msgspec
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, ASGISendEvent
from loguru import logger
from quart import Request, Response, g, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from werkzeug.routing import RequestRedirect

from edge.api.surfaces import APIS, CHAT, COMPLETIONS, MESSAGES, RESPONSES, Api
from edge.errors import (
    AuthenticationError,
    EdgeError,
    MethodNotAllowedError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    RequestError,
    ShuttingDownError,
)
from edge.fleet import readiness
from edge.http import endpoints
from edge.http.chat import ChatService, tenant_of
from edge.http.live import CURRENT as CURRENT_SNAPSHOT
from edge.http.live import Snapshots
from edge.http.scope import CURRENT as CURRENT_SCOPE
from edge.http.scope import ChatScope
from edge.http.spans import RequestTrace
from edge.http.stored import ResponseStates
from edge.limits.limiter import Gate, RateLimitedError
from edge.observe.log import REQUEST_ID
from edge.observe.metrics import CONTENT_TYPE

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Bound on finishing an HTTP cycle once the last body message is sent.
_END_OF_RESPONSE_S = 5.0


def _json_response(value: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status=status, content_type="application/json")


def _error_response(error: EdgeError) -> Response:
    api = endpoints.error_api(request) if request else None
    status, body = api.edge_error(error) if api else (error.status, error.to_dict())
    response = _json_response(body, status)
    if isinstance(error, OverloadedError | RateLimitedError):
        response.headers["Retry-After"] = str(error.retry_after_s)
    if isinstance(error, RateLimitedError):
        response.headers.update(error.headers)
    return response


def _not_found() -> NotFoundError:
    return NotFoundError(f"Unknown path {request.method} {_target()}", code="not_found")


def _target() -> str:
    """The path as the client sent it (percent-escapes kept), for messages."""
    raw = request.scope.get("raw_path")
    return raw.decode("latin-1") if isinstance(raw, bytes) else request.path


def _is_route_path() -> bool:
    """Whether the raw path is exactly the decoded one: no percent-escapes anywhere.

    The routes are plain ASCII, so a path that needed decoding is not one of
    them; `%2F` must not turn into a separator behind the client's back. But
    for a model id: to the SDKs it is one segment, whose `/` (`org/name`) they
    send as `%2F`; after `/v1/models/` as written, escapes are the id's.
    """
    raw = request.scope.get("raw_path")
    if raw is None or raw == request.path.encode():
        return True
    prefix = endpoints.MODELS_PATH + "/"
    return raw.startswith(prefix.encode()) and request.path.startswith(prefix)


def _http_error(exc: HTTPException) -> EdgeError:
    code = exc.code or 500
    if code == 404 or 300 <= code < 400:  # no redirect ever leaves the edge
        return _not_found()
    if code == 405:
        return MethodNotAllowedError(
            f"Method {request.method} is not allowed for {request.path}", code="method_not_allowed"
        )
    if code == 413:
        return PayloadTooLargeError("The request body is too large.", code="payload_too_large")
    error = RequestError(exc.description or exc.name)
    error.status = code  # type: ignore[misc]
    return error


class _HTTPConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection, with the end of each response shielded, and the
    chat request's scope around its whole cycle.

    The last body message makes hypercorn finish the HTTP cycle in this task:
    it queues `http.disconnect` (on which quart-trio cancels this task) and
    then arms the keep-alive timer, or closes the socket when the server is
    shutting down. Cancelled in between, neither happens: idle keep-alive
    connections never time out, and each one holds a draining server open.

    A chat request gets a `ChatScope`: quart-trio runs the handler and the
    body's iteration in one task (`handle_request`), so the scope opened
    there holds the run from the handler to the body's last byte, or to the
    moment the client leaves, whichever comes first. The request is counted
    once: when its run's outcome is fixed, else when the whole cycle is over
    (`__call__`), whatever way it ended.
    """

    async def handle_request(  # type: ignore[override]  # quart-trio's own signature
        self, nursery: trio.Nursery, request: Request, send: ASGISendCallable
    ) -> None:
        async def send_end_shielded(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.move_on_after(_END_OF_RESPONSE_S, shield=True):
                    await send(message)
            else:
                await send(message)

        scope = CURRENT_SCOPE.get()
        if scope is None:
            await super().handle_request(nursery, request, send_end_shielded)
            return
        async with scope.serve():
            await super().handle_request(nursery, request, send_end_shielded)

    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        # The configuration the request runs on, to its end (edge.http.live).
        snapshots: Snapshots = self.app.extensions["snapshots"]
        snapshot_token = CURRENT_SNAPSHOT.set(snapshots.current)
        try:
            await self._serve(receive, send)
        finally:
            CURRENT_SNAPSHOT.reset(snapshot_token)

    async def _serve(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        snapshots: Snapshots = self.app.extensions["snapshots"]
        path = self.scope["path"]
        if path not in APIS or self.scope["method"] == "OPTIONS":  # (a preflight runs nothing)
            await super().__call__(receive, send)
            return
        chat: ChatService = self.app.extensions["chat"]
        scope = ChatScope(chat.metrics, chat.on_outcome, path)
        if chat.tracing is not None:  # the request's span: from here to the cycle's end
            scope.trace = RequestTrace.begin(chat.tracing, self.scope, APIS[path].name)
        gate = Gate(snapshots.request().limiter, chat.metrics)

        async def send_noting_status(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.start":
                scope.http_status = message["status"]
            await send(message)

        token = CURRENT_SCOPE.set(scope)
        gate_token = CURRENT_GATE.set(gate)
        try:
            await super().__call__(receive, send_noting_status)
        finally:
            CURRENT_GATE.reset(gate_token)
            CURRENT_SCOPE.reset(token)
            scope.finish()
            # Usually ended with its run already (edge.http.chat); else here, once.
            run = scope.run
            try:
                await gate.end(run.outcome if run is not None else None)
            finally:
                scope.end_trace()


# The key and limits of the chat request the current task serves (None: not a chat request).
CURRENT_GATE: ContextVar[Gate | None] = ContextVar("iop_chat_gate", default=None)


@dataclass(frozen=True, slots=True)
class EdgeApp:
    """The app the server serves, and the one switch the daemon pulls on it."""

    app: QuartTrio
    # From then on chat requests are answered 503 and /readyz says "draining".
    start_draining: Callable[[], None]


class _Drain:
    """Whether the edge drains (the daemon's `EdgeApp.start_draining` turns it on)."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False

    def start(self) -> None:
        self.on = True


def create_app(chat: ChatService, *, snapshots: Snapshots, max_body_bytes: int) -> EdgeApp:
    """The app of `chat`: each request's snapshot of `snapshots` (taken when it arrives)
    tells its key, its limiter (None: no key has limits) counts it, and its CORS policy
    answers its origin."""
    app = _quart_app(chat, snapshots, max_body_bytes)
    drain = _Drain()
    _request_hooks(app, snapshots)
    _error_handlers(app)
    _api_routes(app, chat, drain)
    _stored_routes(app, chat)
    _no_run_routes(app, chat)
    _probe_routes(app, chat, drain)
    return EdgeApp(app, drain.start)


def _quart_app(chat: ChatService, snapshots: Snapshots, max_body_bytes: int) -> QuartTrio:
    """The quart-trio app, its HTTP cycle the edge's (`_HTTPConnection`), with no route yet."""
    app = QuartTrio("iop-edge")
    app.asgi_http_class = _HTTPConnection
    app.extensions["chat"] = chat
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    # Routes match as written: `//` is not merged into `/` by a redirect.
    app.url_map.merge_slashes = False
    app.extensions["snapshots"] = snapshots
    return app


def _request_hooks(app: QuartTrio, snapshots: Snapshots) -> None:
    """Before each request: its id, the path guard, a CORS preflight, its API key.
    After: its id, CORS and rate-limit headers on the answer, and its log line."""

    @app.before_request
    async def before() -> Response | None:
        offered = request.headers.get("X-Request-Id", "")
        g.request_id = offered if _REQUEST_ID.match(offered) else secrets.token_hex(8)
        # Every line logged while this request is served (and by its run) carries its id.
        REQUEST_ID.set(g.request_id)
        if (chat_scope := CURRENT_SCOPE.get()) is not None:
            chat_scope.request_id = g.request_id
        g.started = time.perf_counter()
        if not _is_route_path() or isinstance(request.routing_exception, RequestRedirect):
            raise _not_found()
        cors = snapshots.request().cors
        if isinstance(known := request.routing_exception, MethodNotAllowed) and (
            preflight := cors.preflight(request, known.valid_methods or ())
        ):
            return preflight  # before the key: a browser's preflight carries none
        g.key = None
        keys = snapshots.request().keys
        if keys.enabled and request.path.startswith("/v1/"):
            g.key = keys.identify(request.headers.get("Authorization"))
            if g.key is None and (api_key := request.headers.get("x-api-key")) is not None:
                g.key = keys.identify(f"Bearer {api_key}")
            if g.key is None:
                raise AuthenticationError(
                    "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' "
                    "or 'x-api-key: <key>'.",
                    code="invalid_api_key",
                )
            if (gate := CURRENT_GATE.get()) is not None:
                gate.key = g.key
        return None

    @app.after_request
    async def after(response: Response) -> Response:
        response.headers.setdefault("X-Request-Id", g.get("request_id", ""))
        snapshots.request().cors.decorate(request, response)
        if (gate := CURRENT_GATE.get() or g.get("gate")) is not None:
            for name, value in gate.headers.items():  # a limited key's, success or not
                response.headers.setdefault(name, value)
        # Chat requests are logged by their scope, once their cycle is over.
        if CURRENT_SCOPE.get() is None:
            logger.bind(
                request_id=g.get("request_id", ""),
                method=request.method,
                path=request.path,
                status=response.status_code,
                duration_ms=round((time.perf_counter() - g.get("started", 0.0)) * 1000, 2),
            ).info("{} {} {}", request.method, request.path, response.status_code)
        return response


def _error_handlers(app: QuartTrio) -> None:
    """Every error a caller sees, through `_error_response`: an EdgeError, an HTTP
    error, and anything else as a logged 500."""

    @app.errorhandler(EdgeError)
    async def on_edge_error(error: EdgeError) -> Response:
        if (chat_scope := CURRENT_SCOPE.get()) is not None and chat_scope.trace is not None:
            chat_scope.trace.error_type = error.type
            chat_scope.trace.error_code = error.code
        return _error_response(error)

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException) -> Response:
        return _error_response(_http_error(exc))

    @app.errorhandler(Exception)
    async def on_unexpected(exc: Exception) -> Response:
        logger.opt(exception=exc).error("unhandled error in {} {}", request.method, request.path)
        return _error_response(EdgeError("The server had an error while processing your request."))


def _api_routes(app: QuartTrio, chat: ChatService, drain: _Drain) -> None:
    """The four APIs, each a run through `chat` (`edge.http.chat`); 503 while draining."""

    async def answer(api: Api) -> Response:
        if drain.on:
            raise ShuttingDownError("The server is shutting down; retry on another instance.")
        scope = CURRENT_SCOPE.get()
        assert scope is not None  # the API routes always run in their scope
        gate = CURRENT_GATE.get()
        tenant = tenant_of(gate.key if gate is not None else None, request.remote_addr)
        if gate is not None:
            scope.key = gate.key.name if gate.key is not None else ""
            # The key's limits before its body is read: a key over them costs no parse.
            chat.admission.shed_if_full(tenant)  # (a shed request is not counted against them)
            await gate.admit()
        session_id = request.headers.get("X-Session-Id") or None
        # The body goes to the handler without a name here: once parsed, the handler's
        # reference is the last, and a request queued or running holds no body.
        response = await chat.handle(
            await request.get_data(cache=False, as_text=False, parse_form_data=False),
            scope,
            session_id=session_id,
            gate=gate,
            api=api,
            tenant=tenant,
        )
        response.timeout = None
        return response

    @app.post(CHAT.path)
    async def chat_completions() -> Response:
        return await answer(CHAT)

    @app.post(RESPONSES.path)
    async def responses() -> Response:
        return await answer(RESPONSES)

    @app.post(MESSAGES.path)
    async def messages() -> Response:
        return await answer(MESSAGES)

    @app.post(COMPLETIONS.path)  # the legacy completions API
    async def completions() -> Response:
        return await answer(COMPLETIONS)


def _stored(chat: ChatService) -> tuple[ResponseStates, str]:
    """The response store and the owner of what this request may read (its key's)."""
    if chat.responses is None:
        raise NotFoundError(
            'This edge keeps no responses ([responses] store = "off").',
            code="response_not_found",
        )
    key = g.get("key")
    return chat.responses, key.name if key is not None else ""


@asynccontextmanager
async def _admitted(chat: ChatService) -> AsyncIterator[Gate]:
    """A request that reads a body or stored items, admitted by its key's limits
    first (edge.http.endpoints.admitted); its rate-limit headers go on its answer."""
    async with endpoints.admitted(chat, g.get("key")) as gate:
        g.gate = gate
        yield gate


def _stored_routes(app: QuartTrio, chat: ChatService) -> None:
    """Stored responses (`edge.http.stored`): read, delete, input items."""

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> Response:
        states, owner = _stored(chat)
        async with _admitted(chat):
            return await endpoints.stored_response(chat, states, owner, response_id)

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        states, owner = _stored(chat)
        body = await states.delete(owner, response_id)
        return Response(body, status=200, content_type="application/json")

    @app.get("/v1/responses/<response_id>/input_items")
    async def response_input_items(response_id: str) -> Response:
        states, owner = _stored(chat)
        async with _admitted(chat):
            return await endpoints.input_items(chat, states, owner, response_id, request.args)


def _no_run_routes(app: QuartTrio, chat: ChatService) -> None:
    """The `/v1/` endpoints that start no run (`edge.http.endpoints`)."""

    @app.get(endpoints.MODELS_PATH)
    async def models() -> Response:
        return endpoints.models(chat, request, g.get("key"))

    @app.get(endpoints.MODELS_PATH + "/<path:model_id>")  # ids may hold "/" (org/name)
    async def model(model_id: str) -> Response:
        return endpoints.model(chat, request, g.get("key"), model_id)

    @app.post(endpoints.COUNT_TOKENS_PATH)
    async def count_tokens() -> Response:
        async with _admitted(chat) as gate:  # a key over its limits: 429, its body not read
            body = await request.get_data(cache=False, as_text=False, parse_form_data=False)
            return await endpoints.count_tokens(chat, body, gate)


def _probe_routes(app: QuartTrio, chat: ChatService, drain: _Drain) -> None:
    """What probes and scrapers ask: liveness, readiness, metrics."""

    @app.get("/healthz")
    @app.get("/health")  # vLLM's and SGLang's path, which their gateways and probes ask
    async def healthz() -> Response:
        return _json_response({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        return _readiness(chat, drain.on)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(chat.metrics.render(), status=200, content_type=CONTENT_TYPE)


def _readiness(chat: ChatService, draining: bool) -> Response:
    """/readyz: ready while some node can take a run and the edge is not draining."""
    shown = readiness.report(chat.pool, draining=draining, queue=chat.admission.report())
    return _json_response(shown.body, 200 if shown.ready else 503)
