"""What a Responses request refers to in the response store, and what it leaves there.

A request with `store: true` (OpenAI's default) leaves its response in the store
(`edge.store`): the Response object, and the items the response was given (the earlier
turns' items and this request's input, references resolved: its *context*). A later
request continues from it with `previous_response_id` (the context and the output come
before its own input; the `instructions` are not carried over, as OpenAI does), or
names one of its output items with `{"type": "item_reference", "id": ...}`.

This module owns the pure half of that: `scan_references` reads which ids a body names
and how often (before the store is asked, so the store is asked once, before the
parse), `Resolved` is what the store gave back for them, `expansion` what they come
to once each reference stands for its item (bounded before anything is copied),
`with_items` puts the items in their place (each stored item decoded once, the one
object shared by all its references), and the 404s a missing reference answers. The
store itself (files, Redis, threads) is `edge.store`'s; the I/O around a request
`edge.http`'s.

Pure: bytes in, values out (or a `RequestError`). No HTTP, no trio.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from edge.errors import NotFoundError, PayloadTooLargeError, RequestError
from edge.observe.logbound import clip_repr

# The longest response or item id the store is asked for: the edge's own are ~40
# characters; a longer one cannot be there (and is answered 404 without asking).
MAX_ID_CHARS: Final = 256
_RESEND: Final = (
    "It may have expired, been evicted from the edge's response store or deleted, or "
    "belong to another API key. Send the conversation's items in 'input' instead."
)


class _ItemScan(msgspec.Struct):
    type: Any = None
    id: Any = None


class _BodyScan(msgspec.Struct):
    previous_response_id: Any = None
    input: str | list[_ItemScan] | None = None


class _PreviousScan(msgspec.Struct):
    previous_response_id: Any = None


@dataclass(frozen=True, slots=True)
class References:
    """The stored things a request body names: its previous response, its item ids (each
    once), and how many of the body's references name each of them."""

    previous: str | None = None
    items: tuple[str, ...] = ()
    # uses[i]: the references to items[i] (1 when not given).
    uses: tuple[int, ...] = ()

    def uses_of(self) -> dict[str, int]:
        """Each item id and how many references name it."""
        return {item: self.uses[i] if i < len(self.uses) else 1
                for i, item in enumerate(self.items)}  # fmt: skip

    def __bool__(self) -> bool:
        return self.previous is not None or bool(self.items)


def _usable(value: object) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else None


def scan_references(body: bytes) -> References:
    """The ids `body` refers to (each item id once, in order, with how many references
    name it); nothing for a body the parser will refuse anyway (not JSON, an `input` of
    another type): the parse says why.

    Typed decoding: only `previous_response_id` and each item's `type` and `id` are
    built; everything else in the body is skipped by the decoder.
    """
    try:
        scan = msgspec.json.decode(body, type=_BodyScan)
    except (msgspec.ValidationError, RecursionError):
        try:  # an odd `input` (the parse refuses it): the previous response still counts
            return References(_usable(msgspec.json.decode(body, type=_PreviousScan)
                                       .previous_response_id))  # fmt: skip
        except (msgspec.DecodeError, RecursionError):
            return References()
    except msgspec.DecodeError:
        return References()
    items: dict[str, int] = {}
    if isinstance(scan.input, list):
        for item in scan.input:
            if item.type == "item_reference" and (found := _usable(item.id)) is not None:
                items[found] = items.get(found, 0) + 1
    return References(_usable(scan.previous_response_id), tuple(items), tuple(items.values()))


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A stored response as the store keeps it: its Response object and its context,
    both JSON (an object, and an array of items)."""

    response: bytes
    context: bytes


@dataclass(frozen=True, slots=True)
class Resolved:
    """What the store holds of a request's references (a missing one is left out)."""

    previous: StoredResponse | None = None
    # Output items by id, each a JSON object.
    items: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The bytes the store gave back (what the parse decodes on top of the body)."""
        previous = self.previous
        held = 0 if previous is None else len(previous.response) + len(previous.context)
        return held + sum(len(v) for v in self.items.values())


def expansion(refs: References, resolved: Resolved, *, limit: int) -> int:
    """The bytes of stored JSON the request's references come to once each stands for
    what it names: the previous response (its Response object and its context) once,
    each item's bytes times its references. Computed from the stored items' sizes
    before any is decoded or copied: a small body of many references to one large item
    would otherwise be built into a request of hundreds of megabytes before being
    refused. Linear in the distinct ids.

    Raises:
        PayloadTooLargeError: (413) it comes to more than `limit` bytes.
    """
    previous = resolved.previous
    total = 0 if previous is None else len(previous.response) + len(previous.context)
    found = resolved.items
    for item, uses in refs.uses_of().items():
        data = found.get(item)
        if data is not None:
            total += uses * len(data)
    if total > limit:
        raise PayloadTooLargeError(
            f"The stored response and items this request refers to come to {total} bytes "
            f"once each reference is expanded (an item_reference counts its item's bytes "
            f"each time), more than the {limit} bytes a request to a node may hold (the "
            "nodes' gRPC message limit): refer to each item once, or send the "
            "conversation's items in 'input' instead.",
            param="input",
            code="references_too_large",
        )
    return total


def previous_not_found(response_id: object) -> NotFoundError:
    return NotFoundError(
        f"Previous response with id {clip_repr(response_id, 80)} not found. {_RESEND}",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def item_not_found(item_id: object, at: str) -> NotFoundError:
    return NotFoundError(
        f"Item with id {clip_repr(item_id, 80)} ({at}) not found. {_RESEND}",
        param="input",
        code="item_not_found",
    )


def response_not_found(response_id: str) -> NotFoundError:
    return NotFoundError(
        f"Response with id {clip_repr(response_id, 80)} not found.",
        param="response_id",
        code="response_not_found",
    )


def history(resolved: Resolved, previous_id: object) -> list[dict[str, Any]]:
    """The items a response continues from: the previous response's context, then its
    output (an empty list without `previous_response_id`).

    Raises:
        RequestError: `previous_response_id` is not a string.
        NotFoundError: the store does not hold it (or what it holds is not a response).
    """
    if previous_id is None:
        return []
    if not isinstance(previous_id, str):
        raise RequestError(
            "Invalid type for 'previous_response_id': expected a string.",
            param="previous_response_id",
        )
    stored = resolved.previous
    if stored is None or _usable(previous_id) is None:
        raise previous_not_found(previous_id)
    context = _decode(stored.context)
    response = _decode(stored.response)
    output = response.get("output") if isinstance(response, dict) else None
    if not isinstance(context, list) or not isinstance(output, list):
        raise previous_not_found(previous_id)  # not a record this edge wrote
    return [*_objects(context), *_objects(output)]


def with_items(value: object, resolved: Resolved) -> object:
    """This request's `input` with each `item_reference` replaced by the item the store
    holds; any other value is returned as it is (a string, or one the parse refuses).
    Each stored item is decoded once: its references share the one object (read, never
    changed, by the parse).

    Raises:
        NotFoundError: an item the store does not hold.
    """
    if not isinstance(value, list):
        return value
    items: list[Any] = []
    decoded: dict[str, object] = {}
    for i, item in enumerate(value):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            stored: object = None
            if (item_id := _usable(item.get("id"))) is not None:
                if item_id in decoded:
                    stored = decoded[item_id]
                elif (found := resolved.items.get(item_id)) is not None:
                    stored = decoded[item_id] = _decode(found)
            if not isinstance(stored, dict) or stored.get("type") == "item_reference":
                raise item_not_found(item.get("id"), f"input[{i}]")
            item = stored
        items.append(item)
    return items


def as_items(value: object) -> list[Any]:
    """A parsed `input` as the list of items the store keeps: a string is one user
    message, and a message without its `type` (OpenAI's "easy" form) gets it."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": value}]}]  # fmt: skip
    if not isinstance(value, list):
        return []
    return [{"type": "message", **item} if isinstance(item, dict) and "type" not in item
            else item for item in value]  # fmt: skip


def _decode(data: bytes) -> object:
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None


def _objects(items: list[Any]) -> list[dict[str, Any]]:
    return [item for item in items if isinstance(item, dict)]


def input_items_page(response_id: str, context: bytes, query: Mapping[str, str]) -> bytes:
    """`GET /v1/responses/{id}/input_items` as OpenAI pages it (`limit` 1 to 100, default
    20; `order` desc, the default, or asc; `after` an item id), as JSON. An item stored
    without an id gets one made of the response's and its place.

    Raises:
        RequestError: a query parameter out of its range.
    """
    raw_limit = query.get("limit", "20")
    if not (raw_limit.isascii() and raw_limit.isdigit() and 1 <= int(raw_limit) <= 100):
        raise RequestError("Invalid 'limit': expected an integer from 1 to 100.", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError("Invalid 'order': expected 'asc' or 'desc'.", param="order")
    decoded = _decode(context)
    items = _objects(decoded) if isinstance(decoded, list) else []
    base = response_id.removeprefix("resp_")
    items = [item if isinstance(item.get("id"), str) else {"id": f"in_{base}_{i}", **item}
             for i, item in enumerate(items)]  # fmt: skip
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        items = items[at + 1 :] if at is not None else []
    page = items[: int(raw_limit)]
    return msgspec.json.encode({
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    })  # fmt: skip
