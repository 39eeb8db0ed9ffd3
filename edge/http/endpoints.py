"""The endpoints that start no run: the model catalog and Anthropic's token count.

`GET /v1/models` and `GET /v1/models/{id}` list the models the nodes serve
(and the request's key may use) in OpenAI's shape, or Anthropic's when the
request looks like an Anthropic client's (`edge.api.catalog`); an id that is
not there (or that the key may not use) is the 404 `model_not_found`.

`POST /v1/messages/count_tokens` parses its body with the Messages parser and
answers `{"input_tokens": N}`, an estimate (`edge.api.tokencount`): no node is
asked, and the parse and count run in a worker thread, holding their share of the
memory budget, as a chat request's parse does (`edge.http.chat`).

Every endpoint that reads a body or stored items (count_tokens, a stored response
and its input items) is admitted as a chat request is (`admitted`): its key's limits
are counted from its headers, before its body is read or the store asked (a key over
them is answered 429 and nothing is parsed), its model allow-list applies once the
model is known, and what it decodes is charged to the memory budget first.

`error_api` says which API's shape an error of a path takes: Anthropic's
under `/v1/messages` (count_tokens, an unknown path there, a 405, an auth
error) and for an Anthropic client's `/v1/models` requests; else the API of
the path, or OpenAI's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import msgspec
import trio
from quart import Request, Response

from edge.api.catalog import anthropic_model, model_list, openai_model
from edge.api.surfaces import APIS, MESSAGES, MESSAGES_PATH, Api
from edge.api.tokencount import estimate_input_tokens, parse_count_request
from edge.contract.prefix import CHARS_PER_TOKEN
from edge.http.chat import PARSE_PEAK_FACTOR, ChatService
from edge.http.stored import ResponseStates
from edge.limits.limiter import Gate, Key, model_not_found

MODELS_PATH = "/v1/models"
COUNT_TOKENS_PATH = MESSAGES_PATH + "/count_tokens"


def looks_anthropic(request: Request) -> bool:
    """Whether `request` comes from an Anthropic client (its SDKs send both headers)."""
    headers = request.headers
    return "anthropic-version" in headers or "x-api-key" in headers


def error_api(request: Request) -> Api | None:
    """The API whose error shape `request`'s errors take (None: OpenAI's)."""
    path = request.path
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
        return MESSAGES
    if (path == MODELS_PATH or path.startswith(MODELS_PATH + "/")) and looks_anthropic(request):
        return MESSAGES
    return APIS.get(path)


def _json(value: object) -> Response:
    return Response(msgspec.json.encode(value), status=200, content_type="application/json")


def _models(chat: ChatService, key: Key | None) -> list[str]:
    return [m for m in chat.pool.models() if key is None or key.allows(m)]


def models(chat: ChatService, request: Request, key: Key | None) -> Response:
    """`GET /v1/models`: the models `key` may use, in the client's API's shape."""
    return _json(model_list(_models(chat, key), anthropic=looks_anthropic(request)))


def model(chat: ChatService, request: Request, key: Key | None, model_id: str) -> Response:
    """`GET /v1/models/{id}`: the model, or 404 `model_not_found` (raised)."""
    if model_id not in _models(chat, key):
        raise model_not_found(model_id)
    if looks_anthropic(request):
        return _json(anthropic_model(model_id))
    return _json(openai_model(model_id))


@asynccontextmanager
async def admitted(chat: ChatService, key: Key | None) -> AsyncIterator[Gate]:
    """The request of `key` admitted by its limits (RateLimitedError, 429, when over them)
    for as long as the block runs: enter it before the body is read or the store asked.
    Its stream (`max_streams`) is given back when the block ends, however it ends."""
    gate = Gate(chat.snapshots.request().limiter, chat.metrics)
    gate.key = key
    try:
        await gate.admit()
        yield gate
    finally:
        await gate.end(None)


def charge(chat: ChatService) -> Callable[[int], Callable[[], None]]:
    """The memory budget's charge for decoding `nbytes` (what a parse holds at its peak,
    at most the whole budget): OverloadedError (503) when it has not that much left; the
    charge returns the call that gives them back."""
    budget = chat.snapshots.request().config.admission.memory_budget_bytes

    def hold(nbytes: int) -> Callable[[], None]:
        return chat.admission.hold(min(PARSE_PEAK_FACTOR * nbytes, budget))

    return hold


async def count_tokens(chat: ChatService, body: bytes, gate: Gate) -> Response:
    """`POST /v1/messages/count_tokens`: `{"input_tokens": N}`, estimated; a bad body is
    a RequestError, a model not served (or not the key's) `model_not_found` (raised)."""
    await chat.turns.turn()
    peak = charge(chat)(len(body))
    try:
        with chat.gil.large(len(body)):
            tokens, model_id = await trio.to_thread.run_sync(_count, body, limiter=chat.parsing)
    finally:
        peak()
    await gate.check_model(model_id)  # not the key's: not counted, and a 404
    if model_id not in _models(chat, gate.key):
        raise model_not_found(model_id)
    return _json({"input_tokens": tokens})


async def stored_response(
    chat: ChatService, states: ResponseStates, owner: str, response_id: str
) -> Response:
    """`GET /v1/responses/{id}`: the stored Response object, sent as stored (never
    decoded): answered only while the memory budget has room for its bytes (else 503
    `overloaded`, as a request to parse would be)."""
    body = await states.response(owner, response_id)
    chat.admission.hold(len(body))()
    return Response(body, status=200, content_type="application/json")


async def input_items(
    chat: ChatService,
    states: ResponseStates,
    owner: str,
    response_id: str,
    query: Mapping[str, str],
) -> Response:
    """`GET /v1/responses/{id}/input_items`: a page of the items the response was given,
    decoded within the memory budget."""
    body = await states.input_items(owner, response_id, query, charge(chat))
    return Response(body, status=200, content_type="application/json")


def _count(body: bytes) -> tuple[int, str]:
    """In a worker thread: the body parsed and its prompt's tokens estimated."""
    request = parse_count_request(body).chat
    return estimate_input_tokens(request, chars_per_token=CHARS_PER_TOKEN), request.model
