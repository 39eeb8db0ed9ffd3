"""The response store around `/v1/responses` requests: references resolved before the
parse, the answer saved once it ended, and the stored responses' own routes.

Before the parse (`resolve`): the ids the body names are read in a worker thread
(`edge.api.responses_state.scan_references`) and fetched from the store in one call,
as the request's key (its name is the owner; "" without keys). A read the store cannot
answer is a 503 `service_unavailable` saying to retry or send the items; a reference
the store does not hold is the parser's 404. What the references come to once
expanded (each item's bytes times its references) is reckoned from the bytes fetched,
in the same thread's way, before anything is decoded: over the nodes' gRPC message
limit it is a 413 (`references_too_large`), and under it the caller charges the memory
budget for it before the parse expands them.

After the answer (`save`): a response that ended `completed` or `incomplete` is stored
with its context (a failed or cut one is not). The streaming answer saves once its
terminal event went out, before its body ends; the non-streaming one before its body
goes. A save never fails the request: it has a deadline of its own, runs shielded (the
client may have left), and a store that fails, is late, or a response over
`max_response_bytes` is logged and counted (`iop_edge_responses_stored_total{result}`).

GET, DELETE and the input items of a stored response answer what the key stored, in
OpenAI's shapes; anything else (another key's, expired, evicted) is a 404.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Final

import msgspec
import trio
from loguru import logger

from edge.api.responses_state import (
    References,
    Resolved,
    expansion,
    input_items_page,
    response_not_found,
)
from edge.api.surfaces import Api
from edge.contract.routes import MAX_MESSAGE_BYTES
from edge.errors import PayloadTooLargeError, StoreUnavailableError
from edge.observe.logbound import clip
from edge.observe.metrics import EdgeMetrics
from edge.store.base import ResponseStore, StoreUnavailable, TooMuchReferenced

# The longest a save holds the end of its answer (the store's own deadlines are shorter).
SAVE_DEADLINE_S: Final = 10.0
# The statuses of a response that is stored.
STORED_STATUSES: Final = frozenset({"completed", "incomplete"})
_UNREADABLE: Final = (
    "The edge's response store could not be read ({kind}); retry, or send the "
    "conversation's items in 'input' instead of referring to stored ones."
)


class ResponseStates:
    """The response store as the HTTP layer uses it (see the module doc)."""

    def __init__(self, store: ResponseStore, metrics: EdgeMetrics) -> None:
        self.store = store
        self._metrics = metrics

    def _unavailable(self, op: str, exc: StoreUnavailable) -> StoreUnavailableError:
        self._metrics.responses_store_errors.labels(op).inc()
        logger.warning("responses store ({}) failed to {}: {}", self.store.kind, op, clip(str(exc)))
        return StoreUnavailableError(
            _UNREADABLE.format(kind=self.store.kind), code="store_unavailable"
        )

    async def resolve(
        self, api: Api, body: bytes, owner: str, limiter: trio.CapacityLimiter
    ) -> tuple[Resolved, int]:
        """What the store holds of what `body` refers to (nothing referred: no store call),
        and the bytes it comes to once each reference is expanded (`expansion`).

        Raises:
            StoreUnavailableError: the store could not be read.
            PayloadTooLargeError: what it refers to is over the store's bound, or would
                be over the nodes' message limit once expanded.
        """
        refs: References = await trio.to_thread.run_sync(api.references, body, limiter=limiter)
        if not refs:
            return Resolved(), 0
        resolved = await self._fetch(owner, refs)
        expanded = await trio.to_thread.run_sync(
            partial(expansion, refs, resolved, limit=MAX_MESSAGE_BYTES), limiter=limiter
        )
        return resolved, expanded

    async def _fetch(self, owner: str, refs: References) -> Resolved:
        try:
            return await self.store.fetch(owner, refs.previous, refs.items)
        except StoreUnavailable as exc:
            raise self._unavailable("read", exc) from None
        except TooMuchReferenced as exc:
            raise PayloadTooLargeError(
                "The stored response and items this request refers to come to more than "
                f"{exc.limit} bytes ([responses] max_response_bytes):"
                " send the conversation's items in 'input' instead.",
                param="input",
                code="references_too_large",
            ) from None

    async def save(self, owner: str, context: bytes, response: Mapping[str, Any]) -> None:
        """Store `response` (given `context`) if it ended completed or incomplete; never
        raises for the store's sake, and ends within SAVE_DEADLINE_S even if cancelled."""
        if response.get("status") not in STORED_STATUSES:
            return
        result = "failed"
        with trio.move_on_after(SAVE_DEADLINE_S, shield=True) as deadline:
            try:
                result = "stored" if await self.store.put(owner, response, context) else "too_large"
            except StoreUnavailable as exc:
                self._unavailable("write", exc)
        if deadline.cancelled_caught:
            self._metrics.responses_store_errors.labels("write").inc()
            logger.warning("responses store ({}): a write missed its deadline", self.store.kind)
        if result == "too_large":
            logger.info(
                "response {} not stored: over [responses] max_response_bytes", response.get("id")
            )
        self._metrics.responses_stored.labels(result).inc()

    # --- the routes of stored responses ----------------------------------------------

    async def _stored(self, owner: str, response_id: str) -> Resolved:
        try:
            found = await self.store.fetch(owner, response_id, ())
        except StoreUnavailable as exc:
            raise self._unavailable("read", exc) from None
        if found.previous is None:
            raise response_not_found(response_id)
        return found

    async def response(self, owner: str, response_id: str) -> bytes:
        """`GET /v1/responses/{id}`: the stored Response object, as JSON."""
        found = await self._stored(owner, response_id)
        assert found.previous is not None
        return found.previous.response

    async def delete(self, owner: str, response_id: str) -> bytes:
        """`DELETE /v1/responses/{id}`: OpenAI's deletion object, as JSON."""
        try:
            deleted = await self.store.delete(owner, response_id)
        except StoreUnavailable as exc:
            raise self._unavailable("delete", exc) from None
        if not deleted:
            raise response_not_found(response_id)
        return msgspec.json.encode({"id": response_id, "object": "response", "deleted": True})

    async def input_items(
        self,
        owner: str,
        response_id: str,
        query: Mapping[str, str],
        charge: Callable[[int], Callable[[], None]],
    ) -> bytes:
        """`GET /v1/responses/{id}/input_items`: a page of the items the response was given.
        The stored items are decoded in a worker thread, once `charge` (the memory budget,
        given the bytes read; it returns the call that gives them back) took them."""
        found = await self._stored(owner, response_id)
        assert found.previous is not None
        context = found.previous.context
        give_back = charge(len(context))
        try:
            return await trio.to_thread.run_sync(input_items_page, response_id, context, query)
        finally:
            give_back()
