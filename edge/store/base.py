"""What every response store is: the `ResponseStore` protocol, its one error, a record.

A store keeps records by (owner, response id), the owner being the API key's name ("" with
no keys), so a key only ever reads what it stored, and indexes each record's output
items by (owner, item id), for `item_reference`. It holds at most `Bounds`: a count, a
sum of bytes (evicting the oldest past either) and an age, in all and per owner (an
owner past its own count or bytes loses its own oldest records, never another's); a
record over the per-response byte bound (or its owner's) is not stored at all.

A record is built where a store's write runs, off the event loop (`make_record`): the
Response object encoded, each output item encoded on its own, and its size. A store
that fails or misses its deadline raises `StoreUnavailable`, and nothing else;
`edge.http` decides what that means (a write is dropped, a read is a 503).

Imports only `edge.api.responses_state` (the values a read gives back); every store
imports this, and it knows none of them (`edge.store.stores` picks one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from edge.api.responses_state import Resolved

_encode = msgspec.json.encode


class StoreUnavailable(Exception):
    """The store failed (a full disk, Redis gone) or did not answer in time."""


class TooMuchReferenced(Exception):
    """What a request refers to comes to more than `max_response_bytes` (`limit`): a
    conversation that large could not be stored again either (the fetch stops there)."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


@dataclass(frozen=True, slots=True)
class Bounds:
    """What a store holds at most (`[responses]`): in all, and per owner (a key, a tenant:
    past its own bounds an owner's oldest records are evicted, never another's)."""

    max_responses: int
    max_bytes: int
    max_response_bytes: int
    ttl_s: float
    # Unset: the totals (one owner may fill the store).
    owner_max_responses: int | None = None
    owner_max_bytes: int | None = None

    def of(self, owner: str) -> tuple[int, int, int]:
        """What `owner` keeps at most: responses, bytes, and the bytes of one response.
        The owner "" (an edge without keys: every client is one tenant) has the totals."""
        count = self.max_responses if self.owner_max_responses is None else self.owner_max_responses
        held = self.max_bytes if self.owner_max_bytes is None else self.owner_max_bytes
        if not owner:
            count, held = self.max_responses, self.max_bytes
        return count, held, min(self.max_response_bytes, held)


@dataclass(frozen=True, slots=True)
class Record:
    """One response as stored: its Response object, its context, its output items."""

    owner: str
    id: str
    response: bytes
    context: bytes
    items: tuple[tuple[str, bytes], ...]

    @property
    def nbytes(self) -> int:
        """What it counts against the store's bytes (its JSON, items counted again)."""
        return len(self.response) + len(self.context) + sum(len(b) for _, b in self.items)


def make_record(owner: str, response: Mapping[str, Any], context: bytes) -> Record:
    """`response` (a Response object) and its `context` (a JSON array) as a record."""
    output = response.get("output")
    items = tuple(
        (item["id"], _encode(item))
        for item in (output if isinstance(output, list) else ())
        if isinstance(item, dict) and isinstance(item.get("id"), str)
    )
    return Record(owner, str(response["id"]), _encode(response), context, items)


class ResponseStore(Protocol):
    """Responses by (owner, id), and their output items by (owner, item id)."""

    # "sqlite" | "redis": the metric label and the log's word for it.
    kind: str

    async def put(self, owner: str, response: Mapping[str, Any], context: bytes) -> bool:
        """Keep `response` for `owner` (evicting the oldest past the bounds); False: it is
        over the per-response byte bound and was not kept."""
        ...

    async def fetch(self, owner: str, response_id: str | None, items: Sequence[str]) -> Resolved:
        """What `owner` has stored of `response_id` and `items` (a missing or expired one
        is left out).

        Raises:
            TooMuchReferenced: it comes to more than `max_response_bytes` (no more is read).
        """
        ...

    async def delete(self, owner: str, response_id: str) -> bool:
        """Forget `owner`'s response `response_id` and its items; False: it was not there."""
        ...

    async def aclose(self) -> None: ...
