"""Responses with state: which ids a body refers to, where the stored items land in the
conversation, what a missing one answers; and the SQLite store's bounds and expiry.

The parse is pure (bytes and `Resolved` in, a request out). The SQLite store is the
real one on a file of the test's own, its clock a variable the test moves.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from edge.api.responses import parse_responses_request
from edge.api.responses_state import (
    MAX_ID_CHARS,
    References,
    Resolved,
    StoredResponse,
    input_items_page,
    scan_references,
)
from edge.config import ConfigError, parse_config
from edge.errors import NotFoundError, RequestError
from edge.store import sqlite as sqlite_store
from edge.store.base import Bounds, TooMuchReferenced
from edge.store.sqlite import SqliteStore

STORED_CONTEXT = [{"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "first question"}]}]  # fmt: skip
STORED_OUTPUT = [
    {"id": "rs_1", "type": "reasoning", "summary": [],
     "content": [{"type": "reasoning_text", "text": "thinking"}]},
    {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "first answer", "annotations": []}]},
]  # fmt: skip
PREVIOUS = StoredResponse(
    msgspec.json.encode({"id": "resp_1", "object": "response", "output": STORED_OUTPUT}),
    msgspec.json.encode(STORED_CONTEXT),
)


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


@pytest.mark.parametrize(
    ("body", "refs"),
    [
        (b'{"input": "hi"}', References()),
        (b'{"previous_response_id": "resp_1", "input": "hi"}', References("resp_1")),
        (b'{"input": [{"type": "item_reference", "id": "a"}, {"role": "user", "content": "x"},'
         b' {"type": "item_reference", "id": "a"}, {"type": "item_reference", "id": "b"}]}',
         References(None, ("a", "b"), (2, 1))),
        (b'{"previous_response_id": "resp_1", "input": 3}', References("resp_1")),
        (b'{"input": [1, 2]}', References()),
        (b"not json", References()),
        (b'{"previous_response_id": 7, "input": [{"type": "item_reference", "id": 5}]}',
         References()),
        (json.dumps({"previous_response_id": "r" * (MAX_ID_CHARS + 1), "input": "x"}).encode(),
         References()),
    ],
)  # fmt: skip
def test_scan_finds_the_ids_a_body_refers_to(body: bytes, refs: References) -> None:
    """Each id once, in order, with its references' count; none for a body the parser
    refuses, a non-string id, or one too long to be the edge's (the parse answers those)."""
    assert scan_references(body) == refs


def test_previous_items_come_after_instructions_and_before_the_input() -> None:
    """previous_response_id: the stored context, then its output (reasoning on its
    assistant message), then this input; the instructions are this request's only;
    what is stored next is the whole conversation as items."""
    parsed = parse_responses_request(
        _body(previous_response_id="resp_1", input="second question", instructions="Be brief."),
        Resolved(PREVIOUS),
    )
    messages = parsed.chat.messages
    assert [(m.role, m.text()) for m in messages] == [
        ("system", "Be brief."),
        ("user", "first question"),
        ("assistant", "first answer"),
        ("user", "second question"),
    ]
    assert messages[2].reasoning_content == "thinking"
    assert parsed.echo["previous_response_id"] == "resp_1"
    assert parsed.echo["store"] is True
    assert parsed.store_context is not None
    stored = msgspec.json.decode(parsed.store_context)
    assert [item.get("id") for item in stored] == [None, "rs_1", "msg_1", None]
    assert stored[-1]["content"] == [{"type": "input_text", "text": "second question"}]


def test_an_item_reference_is_replaced_by_its_item() -> None:
    """Each `item_reference` stands for the stored item, in its place."""
    items = {"msg_1": msgspec.json.encode(STORED_OUTPUT[1])}
    parsed = parse_responses_request(
        _body(input=[{"role": "user", "content": "q"}, {"type": "item_reference", "id": "msg_1"},
                     {"role": "user", "content": "again"}], store=False),
        Resolved(None, items),
    )  # fmt: skip
    assert [(m.role, m.text()) for m in parsed.chat.messages] == [
        ("user", "q"), ("assistant", "first answer"), ("user", "again")
    ]  # fmt: skip
    assert parsed.store_context is None
    assert parsed.echo["store"] is False


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_gone", "input": "x"}, "previous_response_id"),
        ({"input": [{"type": "item_reference", "id": "msg_gone"}]}, "input"),
        ({"input": [{"type": "item_reference"}]}, "input"),
    ],
)
def test_a_reference_the_store_does_not_hold_is_a_404(fields: dict[str, Any], param: str) -> None:
    """404 invalid_request_error naming the id and saying to resend the items."""
    with pytest.raises(NotFoundError) as missing:
        parse_responses_request(_body(**fields), Resolved())
    assert missing.value.status == 404
    assert missing.value.param == param
    assert "Send the conversation's items in 'input'" in missing.value.message


def test_without_a_store_references_are_refused_and_nothing_is_stored() -> None:
    """No store (`resolved` None): previous_response_id is a 400, store echoes false."""
    with pytest.raises(RequestError, match="keeps no state") as refused:
        parse_responses_request(_body(previous_response_id="resp_1", input="x"))
    assert refused.value.status == 400
    parsed = parse_responses_request(_body(input="x"))
    assert parsed.store_context is None
    assert parsed.echo["store"] is False


def test_input_items_pages() -> None:
    """Newest first by default, `limit` and `after` page through, ids made for items
    stored without one; a bad limit is a 400."""
    context = msgspec.json.encode([{"type": "message", "role": "user", "content": "a"},
                                   {"id": "msg_2", "type": "message"},
                                   {"id": "msg_3", "type": "message"}])  # fmt: skip
    first = msgspec.json.decode(input_items_page("resp_x", context, {"limit": "2"}))
    assert [i["id"] for i in first["data"]] == ["msg_3", "msg_2"]
    assert first["has_more"] is True
    rest = msgspec.json.decode(
        input_items_page("resp_x", context, {"limit": "2", "after": first["last_id"]})
    )
    assert [i["id"] for i in rest["data"]] == ["in_x_0"]
    assert rest["has_more"] is False
    with pytest.raises(RequestError):
        input_items_page("resp_x", context, {"limit": "0"})


def _response(n: int, text: str = "") -> dict[str, Any]:
    return {"id": f"resp_{n}", "object": "response", "status": "completed",
            "output": [{"id": f"msg_{n}", "type": "message", "content": text}]}  # fmt: skip


async def test_sqlite_store_bounds_and_expiry(tmp_path: Path) -> None:
    """Count and bytes bound the store (oldest evicted first, items with their
    response); a response over the per-response bound is refused; one past its TTL is
    neither read, referenced nor deleted, and is dropped by the next write; an owner
    reads only its own."""
    now = [1000.0]
    bounds = Bounds(max_responses=3, max_bytes=4096, max_response_bytes=2048, ttl_s=60)
    store = await SqliteStore.open(tmp_path / "r.sqlite3", bounds, clock=lambda: now[0])
    try:
        for n in range(5):
            assert await store.put("a", _response(n), b"[]")
        assert store.totals()[0] == 3
        gone = await store.fetch("a", "resp_1", ["msg_1"])
        assert gone == Resolved()
        kept = await store.fetch("a", "resp_4", ["msg_3", "msg_4"])
        assert kept.previous is not None
        assert sorted(kept.items) == ["msg_3", "msg_4"]
        assert await store.fetch("b", "resp_4", ["msg_4"]) == Resolved()
        assert not await store.put("a", _response(9, "x" * 3000), b"[]")  # over 2048
        for n in range(5, 8):
            assert await store.put("a", _response(n, "y" * 700), b"[]")
        count, held = store.totals()
        assert held <= 4096
        assert count < 3  # the bytes bound came first
        now[0] += 61
        assert await store.fetch("a", "resp_7", ["msg_7"]) == Resolved()
        assert not await store.delete("a", "resp_7")
        assert await store.put("b", _response(10), b"[]")
        assert store.totals()[0] == 1  # the expired ones went with that write
        assert await store.delete("b", "resp_10")
        assert store.totals() == (0, 0)
    finally:
        await store.aclose()


async def test_sqlite_owner_bounds_evict_the_owners_own(tmp_path: Path) -> None:
    """An owner past its own bytes loses its own oldest, never another's; a response over
    its owner's bytes is not kept; the owner "" (no keys) has the store's totals. A file
    of schema version 1 is upgraded in place, its owners' totals counted from its rows."""
    path = tmp_path / "r.sqlite3"
    with closing(sqlite3.connect(path)) as db, db:  # a version-1 file, one response of "a"
        for statement in sqlite_store._SCHEMA[: -len(sqlite_store._OWNERS)]:
            db.execute(statement)
        db.execute(
            "INSERT INTO responses (owner, id, expires_at, nbytes, response, context)"
            " VALUES ('a', 'resp_old', 1e12, 500, x'7b7d', x'5b5d')"
        )
        db.execute("PRAGMA user_version = 1")
    bounds = Bounds(max_responses=100, max_bytes=1 << 16, max_response_bytes=8192, ttl_s=600,
                    owner_max_responses=50, owner_max_bytes=3000)  # fmt: skip
    store = await SqliteStore.open(path, bounds)
    try:
        assert (await store.fetch("a", "resp_old", [])).previous is not None
        assert await store.put("a", _response(0, "a" * 700), b"[]")
        for n in range(1, 8):
            assert await store.put("b", _response(n, "b" * 700), b"[]")
        assert (await store.fetch("a", "resp_0", [])).previous is not None
        assert (await store.fetch("a", "resp_old", [])).previous is not None
        assert (await store.fetch("b", "resp_1", [])).previous is None  # b's oldest went
        assert (await store.fetch("b", "resp_7", [])).previous is not None
        assert not await store.put("b", _response(9, "x" * 3500), b"[]")  # over b's 3000
        for n in range(10, 20):
            assert await store.put("", _response(n, "c" * 700), b"[]")
        assert (await store.fetch("", "resp_10", [])).previous is not None  # the totals
        with closing(sqlite3.connect(path)) as db:
            owners = dict(db.execute("SELECT owner, bytes FROM owner_totals").fetchall())
            rows = dict(db.execute("SELECT owner, SUM(nbytes) FROM responses GROUP BY owner"))
        assert owners == rows
        assert owners["b"] <= 3000
    finally:
        await store.aclose()


async def test_what_a_request_refers_to_is_read_up_to_the_per_response_bound(
    tmp_path: Path,
) -> None:
    """References that come to more than `max_response_bytes` (a conversation that large
    could not be stored again) stop the read with TooMuchReferenced, whatever mix of a
    previous response and items makes them up; under it, all are read."""
    bounds = Bounds(max_responses=100, max_bytes=1 << 20, max_response_bytes=2048, ttl_s=60)
    store = await SqliteStore.open(tmp_path / "r.sqlite3", bounds)
    try:
        for n in range(6):
            assert await store.put("a", _response(n, "z" * 700), b"[]")
        assert len((await store.fetch("a", None, ["msg_0", "msg_1"])).items) == 2
        with pytest.raises(TooMuchReferenced):
            await store.fetch("a", None, [f"msg_{n}" for n in range(6)])
        with pytest.raises(TooMuchReferenced):
            await store.fetch("a", "resp_5", ["msg_0", "msg_1"])
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ({"responses": {"store": "redis"}}, "needs responses.redis_url or limits.redis_url"),
        ({"responses": {"max_bytes": 65536, "max_response_bytes": 65537}}, "at most max_bytes"),
        ({"responses": {"store": "disk"}}, "responses.store"),
        ({"responses": {"redis_url": "http://x"}}, "responses.redis_url"),
    ],
)
def test_responses_config_mistakes(toml: dict[str, Any], message: str) -> None:
    """Each mistake in `[responses]` is one ConfigError naming the key."""
    with pytest.raises(ConfigError, match=message):
        parse_config(toml, "edge.toml")


def test_responses_config() -> None:
    """A relative `path` is beside the config file; Redis may be the limits' one."""
    config = parse_config(
        {"responses": {"path": "r.sqlite3", "store": "redis"},
         "limits": {"redis_url": "redis://127.0.0.1:6379/0"}},
        "/etc/iop-edge/config.toml",
    )  # fmt: skip
    assert config.responses.path == "/etc/iop-edge/r.sqlite3"
    assert config.responses.store == "redis"


_OPEN = """
import sys
from pathlib import Path
from edge.store.base import Bounds
from edge.store import sqlite as sqlite_store
from edge.store.sqlite import SqliteStore
SqliteStore(Path(sys.argv[1]), Bounds(10, 1 << 20, 1 << 16, 60))
"""


def test_workers_opening_one_new_file_at_once_all_open(tmp_path: Path) -> None:
    """Three processes open one new SQLite file at the same moment (as the workers of an
    edge do at startup), three times over: every one opens it (the schema is made once,
    the switch to WAL waits its turn), none fails on a locked database."""
    for round_ in range(3):
        path = tmp_path / f"r{round_}.sqlite3"
        command = [sys.executable, "-c", _OPEN, str(path)]
        openers = [subprocess.Popen(command, stderr=subprocess.PIPE, text=True) for _ in range(3)]
        for opener in openers:
            _, err = opener.communicate(timeout=60)
            assert opener.returncode == 0, err
