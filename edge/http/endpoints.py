"""The endpoints that start no run: the model catalog and Anthropic's token count.

`GET /v1/models` and `GET /v1/models/{id}` list the models the nodes serve
(and the request's key may use) in OpenAI's shape, or Anthropic's when the
request looks like an Anthropic client's (`edge.api.catalog`); an id that is
not there (or that the key may not use) is the 404 `model_not_found`.

`POST /v1/messages/count_tokens` parses its body with the Messages parser and
answers `{"input_tokens": N}`, an estimate (`edge.api.tokencount`): no node is
asked, no key limit is counted (its model allow-list applies), and the parse
and count run in a worker thread, holding their share of the memory budget,
as a chat request's parse does (`edge.http.chat`).

`error_api` says which API's shape an error of a path takes: Anthropic's
under `/v1/messages` (count_tokens, an unknown path there, a 405, an auth
error) and for an Anthropic client's `/v1/models` requests; else the API of
the path, or OpenAI's.
"""

from __future__ import annotations

import msgspec
import trio
from quart import Request, Response

from edge.api.catalog import anthropic_model, model_list, openai_model
from edge.api.surfaces import APIS, MESSAGES, MESSAGES_PATH, Api
from edge.api.tokencount import estimate_input_tokens, parse_count_request
from edge.contract.prefix import CHARS_PER_TOKEN
from edge.http.chat import PARSE_PEAK_FACTOR, ChatService
from edge.limits.limiter import Key, model_not_found

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


async def count_tokens(chat: ChatService, body: bytes, key: Key | None) -> Response:
    """`POST /v1/messages/count_tokens`: `{"input_tokens": N}`, estimated; a bad body is
    a RequestError, a model not served (or not the key's) `model_not_found` (raised)."""
    await chat.turns.turn()
    budget = chat.snapshots.request().config.admission.memory_budget_bytes
    peak = chat.admission.hold(min(PARSE_PEAK_FACTOR * len(body), budget))
    try:
        tokens, model_id = await trio.to_thread.run_sync(_count, body, limiter=chat.parsing)
    finally:
        peak()
    if model_id not in _models(chat, key):
        raise model_not_found(model_id)
    return _json({"input_tokens": tokens})


def _count(body: bytes) -> tuple[int, str]:
    """In a worker thread: the body parsed and its prompt's tokens estimated."""
    request = parse_count_request(body).chat
    return estimate_input_tokens(request, chars_per_token=CHARS_PER_TOKEN), request.model
