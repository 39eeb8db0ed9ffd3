"""The quart-trio application: routes, and errors rendered OpenAI's way.

Every error a caller can see leaves through `_error_response`: an EdgeError
as its status and OpenAI error object, an HTTP error (404, 405, 413) the
same way, and anything unexpected as a logged 500 with no traceback in the
body. Quart's 60 s response timeout is off: the edge owns its deadlines.
"""

from __future__ import annotations

import msgspec
from loguru import logger
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from edge.errors import (
    EdgeError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    RequestError,
    ShuttingDownError,
)
from edge.http.chat import ChatService


def _json_response(value: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status=status, content_type="application/json")


def _error_response(error: EdgeError) -> Response:
    return _json_response(error.to_dict(), error.status)


def _http_error(exc: HTTPException) -> EdgeError:
    code = exc.code or 500
    if code == 404:
        return NotFoundError(f"Unknown path {request.method} {request.path}", code="not_found")
    if code == 405:
        return MethodNotAllowedError(
            f"Method {request.method} is not allowed for {request.path}", code="method_not_allowed"
        )
    if code == 413:
        return PayloadTooLargeError("The request body is too large.", code="payload_too_large")
    error = RequestError(exc.description or exc.name)
    error.status = code  # type: ignore[misc]
    return error


def create_app(chat: ChatService, *, max_body_bytes: int) -> QuartTrio:
    app = QuartTrio("iop-edge")
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    draining = False

    @app.errorhandler(EdgeError)
    async def on_edge_error(error: EdgeError) -> Response:
        return _error_response(error)

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException) -> Response:
        return _error_response(_http_error(exc))

    @app.errorhandler(Exception)
    async def on_unexpected(exc: Exception) -> Response:
        logger.opt(exception=exc).error("unhandled error in {} {}", request.method, request.path)
        error = EdgeError("The server had an error while processing your request.")
        return _error_response(error)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        if draining:
            raise ShuttingDownError("The server is shutting down; retry on another instance.")
        body = await request.get_data(cache=False)
        assert isinstance(body, bytes)
        response = await chat.handle(body)
        response.timeout = None
        return response

    @app.get("/v1/models")
    async def models() -> Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "iop"}
            for m in chat.pool.models()
        ]
        return _json_response({"object": "list", "data": data})

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json_response({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        ready = chat.pool.ready and not draining
        body: dict[str, object] = {
            "status": "ready" if ready else "not ready",
            "nodes": chat.pool.status(),
        }
        if draining:
            body["reason"] = "draining"
        elif not ready:
            body["reason"] = "no node answers its Describe RPC"
        return _json_response(body, 200 if ready else 503)

    def start_draining() -> None:
        nonlocal draining
        draining = True

    app.extensions["start_draining"] = start_draining
    return app
