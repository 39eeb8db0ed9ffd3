"""What a Responses request's references come to once expanded, reckoned before any
stored item is decoded or copied: a small body of many references to one large stored
item is refused (413, naming the limit) from the items' sizes alone, and a request
under the bound decodes each stored item once, its references sharing the object.

Pure: bytes and `Resolved` in, a size, a request or a `PayloadTooLargeError` out.
"""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import msgspec
import pytest

from edge.api.responses import parse_responses_request
from edge.api.responses_state import (
    References,
    Resolved,
    StoredResponse,
    expansion,
    scan_references,
    with_items,
)
from edge.contract.routes import MAX_MESSAGE_BYTES
from edge.errors import PayloadTooLargeError

MiB = 1 << 20
# A stored answer of ~2 MB, as the store gives it back (its JSON).
BIG_ITEM = msgspec.json.encode({
    "id": "msg_big", "type": "message", "role": "assistant", "status": "completed",
    "content": [{"type": "output_text", "text": "x" * 2_000_000, "annotations": []}],
})  # fmt: skip
SMALL_ITEM = msgspec.json.encode({
    "id": "msg_small", "type": "message", "role": "assistant",
    "content": [{"type": "output_text", "text": "small"}],
})  # fmt: skip


def _references(*ids: str) -> bytes:
    refs: list[dict[str, Any]] = [{"type": "item_reference", "id": i} for i in ids]
    return json.dumps(
        {"model": "m", "input": [*refs, {"role": "user", "content": "go on"}]}
    ).encode()


def test_the_scan_counts_each_items_references() -> None:
    """300 references to one item and 2 to another: each id once, with its count."""
    refs = scan_references(_references(*["msg_big"] * 300, "msg_small", "msg_small"))
    assert refs == References(None, ("msg_big", "msg_small"), (300, 2))
    assert refs.uses_of() == {"msg_big": 300, "msg_small": 2}


@pytest.mark.parametrize("count", [300, 3000])
def test_many_references_to_a_large_item_are_refused_from_its_size(count: int) -> None:
    """300 or 3,000 references to a 2 MB item come to 600 MB or 6 GB expanded: refused
    with a 413 whose message names the limit and the size, without decoding or copying
    anything (the reckoning allocates almost nothing)."""
    refs = scan_references(_references(*["msg_big"] * count))
    resolved = Resolved(None, {"msg_big": BIG_ITEM})
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLargeError) as refused:
            expansion(refs, resolved, limit=MAX_MESSAGE_BYTES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MiB
    error = refused.value
    assert (error.status, error.code, error.param) == (413, "references_too_large", "input")
    assert str(MAX_MESSAGE_BYTES) in error.message
    assert str(count * len(BIG_ITEM)) in error.message


def test_the_expansion_counts_each_reference_and_the_previous_response_once() -> None:
    """The previous response's bytes once, each item's bytes times its references, an
    item the store does not hold nothing (its 404 is the parse's)."""
    previous = StoredResponse(b'{"id": "resp_1", "output": []}', b"[]")
    refs = References("resp_1", ("msg_small", "msg_gone"), (3, 5))
    resolved = Resolved(previous, {"msg_small": SMALL_ITEM})
    expected = len(previous.response) + len(previous.context) + 3 * len(SMALL_ITEM)
    assert expansion(refs, resolved, limit=MAX_MESSAGE_BYTES) == expected
    assert expansion(refs, resolved, limit=expected) == expected
    with pytest.raises(PayloadTooLargeError):
        expansion(refs, resolved, limit=expected - 1)


def test_references_under_the_bound_share_one_decoded_item() -> None:
    """An item referred to twice is decoded once: both places hold the one object; the
    parse builds the two messages from it."""
    resolved = Resolved(None, {"msg_small": SMALL_ITEM})
    given = [{"type": "item_reference", "id": "msg_small"},
             {"role": "user", "content": "x"},
             {"type": "item_reference", "id": "msg_small"}]  # fmt: skip
    items = with_items(given, resolved)
    assert isinstance(items, list)
    assert items[0] is items[2]
    assert items[0]["content"][0]["text"] == "small"
    parsed = parse_responses_request(_references("msg_small", "msg_small"), resolved)
    assert [(m.role, m.text()) for m in parsed.chat.messages] == [
        ("assistant", "small"), ("assistant", "small"), ("user", "go on")
    ]  # fmt: skip
