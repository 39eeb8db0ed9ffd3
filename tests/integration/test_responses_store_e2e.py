"""End to end: `/v1/responses` with state, on the edge's response store, with the official
openai SDK, through real edges to an `iop-sim-node` process.

`previous_response_id` and `item_reference` continue a stored response; GET, DELETE
and the input items read it; a key reads only what it stored; `store: false` keeps
nothing; the SQLite store stays within its bounds when overfilled; a response stored
by one worker of `--workers 2` is continued through the other; two edges share one
Redis. A multi-turn sim script proves the history reached the node: the turn it plays
is the number of assistant messages in the conversation it was sent.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from edge.config import KeyConfig, ResponsesConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    edge_config,
    script,
    start_edge,
    stop_edge,
)
from tests.integration.edgeproc import EdgeProcess, edge_process
from tests.integration.redisproc import RedisServer, redis_server
from tests.integration.test_workers_e2e import holder, sim_toml, total, two_workers, workers

__all__ = ["redis_server"]

RESPONSES = "/v1/responses"
# Three turns of the model: each request plays the one its conversation has reached.
TURNS = json.dumps({"turns": [
    {"events": [{"type": "delta", "delta": "First."}, {"type": "complete"}]},
    {"events": [{"type": "delta", "delta": "Second."}, {"type": "complete"}]},
    {"events": [{"type": "delta", "delta": "Third."}, {"type": "complete"}]},
]})  # fmt: skip


def _sdk(url: str, key: str = "unused", **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30, **kw)


async def _call(url: str, call: Any, key: str = "unused") -> Any:
    def run() -> Any:
        with _sdk(url, key) as client:
            return call(client)

    return await trio.to_thread.run_sync(run)


def _streamed(client: openai.OpenAI, **kw: Any) -> Any:
    """A streamed response, as the SDK's accumulator makes it."""
    with client.responses.stream(**kw) as stream:
        for _ in stream:
            pass
        return stream.get_final_response()


async def test_a_conversation_through_previous_response_id(edge: RunningEdge) -> None:
    """Three turns, each continuing the last by `previous_response_id` (the first and the
    last streamed): each plays the next turn of the script (the node was sent every
    earlier answer), echoes the id it continued, and says it was stored; the
    instructions are not carried over."""

    def conversation(client: openai.OpenAI) -> list[Any]:
        r1 = _streamed(client, model="sim-script", input=TURNS, instructions="Be brief.")
        r2 = client.responses.create(model="sim-script", input="go on", previous_response_id=r1.id)
        r3 = _streamed(client, model="sim-script", input="more", previous_response_id=r2.id)
        return [r1, r2, r3]

    r1, r2, r3 = await _call(edge.url, conversation)
    assert [r.output_text for r in (r1, r2, r3)] == ["First.", "Second.", "Third."]
    assert (r2.previous_response_id, r3.previous_response_id) == (r1.id, r2.id)
    assert [r.store for r in (r1, r2, r3)] == [True, True, True]
    assert r1.instructions == "Be brief."
    assert r2.instructions is None


async def test_item_reference_get_input_items_and_delete(edge: RunningEdge) -> None:
    """An `item_reference` to a stored answer's message stands for that message (the
    second turn plays); GET returns the stored Response; its input items list what it
    was given; DELETE answers OpenAI's deletion object, and then GET, DELETE and a
    reference to it are 404s."""

    def flow(client: openai.OpenAI) -> tuple[Any, Any, Any, Any]:
        r1 = client.responses.create(model="sim-script", input=TURNS)
        r2 = client.responses.create(model="sim-script", input=[
            {"role": "user", "content": TURNS},
            {"type": "item_reference", "id": r1.output[0].id},
            {"role": "user", "content": "and then?"},
        ])  # fmt: skip
        fetched = client.responses.retrieve(r2.id)
        items = client.responses.input_items.list(r2.id, order="asc")
        return r1, r2, fetched, items

    r1, r2, fetched, items = await _call(edge.url, flow)
    assert r2.output_text == "Second."
    assert fetched.id == r2.id
    assert fetched.output_text == "Second."
    assert fetched.status == "completed"
    kinds = [(item.type, getattr(item, "role", None)) for item in items.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items.data[1].id == r1.output[0].id
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as http:
        deleted = await http.delete(f"{RESPONSES}/{r2.id}")
        assert deleted.status_code == 200
        assert deleted.json() == {"id": r2.id, "object": "response", "deleted": True}
        for method in ("GET", "DELETE"):
            gone = await http.request(method, f"{RESPONSES}/{r2.id}")
            assert gone.status_code == 404
            assert gone.json()["error"]["type"] == "invalid_request_error"
        body = {"model": "sim-script", "input": "x", "previous_response_id": r2.id}
        missing = await http.post(RESPONSES, json=body)
    assert missing.status_code == 404


async def test_an_unknown_reference_is_a_404_naming_it(edge: RunningEdge) -> None:
    """A previous response or an item the store does not hold: 404, OpenAI's error object
    with its param, a message that names the id and says to send the items instead."""
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as http:
        previous = await http.post(RESPONSES, json={
            "model": "sim-echo", "input": "hi", "previous_response_id": "resp_nope",
        })  # fmt: skip
        item = await http.post(RESPONSES, json={
            "model": "sim-echo", "input": [{"type": "item_reference", "id": "msg_nope"}],
        })  # fmt: skip
    for response, param, missing in ((previous, "previous_response_id", "resp_nope"),
                                     (item, "input", "msg_nope")):  # fmt: skip
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        assert missing in error["message"]
        assert "Send the conversation's items in 'input'" in error["message"]


async def test_store_false_keeps_nothing(edge: RunningEdge) -> None:
    """`store: false`: the answer says so, and neither GET nor a continuation finds it."""

    def flow(client: openai.OpenAI) -> Any:
        return client.responses.create(model="sim-echo", input="forget me", store=False)

    response = await _call(edge.url, flow)
    assert response.store is False
    assert response.output_text == "forget me"
    with pytest.raises(openai.NotFoundError):
        await _call(edge.url, lambda c: c.responses.retrieve(response.id))
    with pytest.raises(openai.NotFoundError, match=response.id):
        await _call(
            edge.url,
            lambda c: c.responses.create(model="sim-echo", input="x",
                                         previous_response_id=response.id),
        )  # fmt: skip


async def test_a_key_reads_only_what_it_stored(nursery: trio.Nursery, sim: SimProcess) -> None:
    """With two keys: what key a stored, key b can neither GET, DELETE, continue nor
    reference (404s, as if it did not exist); key a can."""
    keys = (KeyConfig("team-a", "sk-a"), KeyConfig("team-b", "sk-b"))
    running = await start_edge(nursery, replace(edge_config(sim), keys=keys))
    try:
        r1 = await _call(running.url, lambda c: c.responses.create(
            model="sim-script", input=TURNS), key="sk-a")  # fmt: skip
        for attempt in (
            lambda c: c.responses.retrieve(r1.id),
            lambda c: c.responses.delete(r1.id),
            lambda c: c.responses.create(model="sim-script", input="x", previous_response_id=r1.id),
            lambda c: c.responses.create(model="sim-script", input=[
                {"role": "user", "content": TURNS},
                {"type": "item_reference", "id": r1.output[0].id}]),
        ):  # fmt: skip
            with pytest.raises(openai.NotFoundError):
                await _call(running.url, attempt, key="sk-b")
        r2 = await _call(running.url, lambda c: c.responses.create(
            model="sim-script", input="x", previous_response_id=r1.id), key="sk-a")  # fmt: skip
        assert r2.output_text == "Second."
    finally:
        await stop_edge(running)


async def test_the_store_stays_within_its_bounds(
    nursery: trio.Nursery, sim: SimProcess, tmp_path: Path
) -> None:
    """Overfilled: by count (3 at most: the oldest go first), then by bytes (two large
    responses of ~37 KB do not fit in 64 KiB: the second evicts everything older, so
    one response is left, under the count bound), and one response over
    max_response_bytes is answered but not kept (counted as too_large). The file's own
    totals agree with a count of its rows."""
    path = tmp_path / "responses.sqlite3"
    settings = ResponsesConfig(path=str(path), max_responses=3, max_bytes=65536,
                               max_response_bytes=49152)  # fmt: skip
    running = await start_edge(nursery, replace(edge_config(sim), responses=settings))

    def stored() -> tuple[int, int]:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            count, held = db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM responses"
                                     ).fetchone()  # fmt: skip
            assert db.execute("SELECT count, bytes FROM totals").fetchone() == (count, held)
        return count, held

    def big(size: int) -> str:
        return script({"type": "delta", "delta": "x" * size}, {"type": "complete"})

    try:
        small = [await _call(running.url, lambda c, i=i: c.responses.create(
            model="sim-echo", input=f"small {i}")) for i in range(5)]  # fmt: skip
        assert stored()[0] == 3
        with pytest.raises(openai.NotFoundError):
            await _call(running.url, lambda c: c.responses.retrieve(small[0].id))
        assert (await _call(running.url, lambda c: c.responses.retrieve(small[4].id))).id
        large = [await _call(running.url, lambda c: c.responses.create(
            model="sim-script", input=big(12000))) for _ in range(2)]  # fmt: skip
        count, held = stored()
        assert count == 1
        assert 24000 < held <= 65536
        assert (await _call(running.url, lambda c: c.responses.retrieve(large[1].id))).id
        with pytest.raises(openai.NotFoundError):
            await _call(running.url, lambda c: c.responses.retrieve(small[4].id))
        huge = await _call(running.url, lambda c: c.responses.create(
            model="sim-script", input=big(20000)))  # fmt: skip
        assert len(huge.output_text) == 20000
        with pytest.raises(openai.NotFoundError):
            await _call(running.url, lambda c: c.responses.retrieve(huge.id))
        assert stored()[1] <= 65536
        async with httpx.AsyncClient(base_url=running.url, timeout=10) as http:
            metrics = (await http.get("/metrics")).text
        assert total(metrics, "iop_edge_responses_stored_total", result="too_large") == 1
        assert total(metrics, "iop_edge_responses_stored_total", result="stored") == 7
    finally:
        await stop_edge(running)


async def test_a_response_stored_by_one_worker_is_continued_through_the_other(
    sim: SimProcess, tmp_path: Path
) -> None:
    """`--workers 2`: a response created on a connection one worker holds (the kernel says
    which) is continued with `previous_response_id`, and read with GET, on a connection
    the other worker holds: both share the edge's one SQLite file."""
    async with two_workers(tmp_path, sim_toml(sim)) as edge:
        port = int(edge.url.rsplit(":", 1)[1])
        pids = [p.pid for p in workers(edge)]
        async with AsyncExitStack() as stack:
            by_worker: dict[int, httpx.Client] = {}
            for _ in range(40):  # new connections until each worker holds one
                client = stack.enter_context(httpx.Client(base_url=edge.url, timeout=30))
                client_port = await trio.to_thread.run_sync(_client_port, client)
                pid = holder(pids, client_port, port)
                if pid is not None:
                    by_worker.setdefault(pid, client)
                if len(by_worker) == 2:
                    break
            assert len(by_worker) == 2, "no connection reached the second worker"
            first, second = by_worker.values()

            def on(client: httpx.Client, call: Any) -> Any:
                # On that client's kept-alive connection (closed with the stack, not here).
                return call(_sdk(edge.url, http_client=client))

            r1 = await trio.to_thread.run_sync(on, first, lambda c: _streamed(
                c, model="sim-script", input=TURNS))  # fmt: skip
            r2 = await trio.to_thread.run_sync(on, second, lambda c: c.responses.create(
                model="sim-script", input="go on", previous_response_id=r1.id))  # fmt: skip
            again = await trio.to_thread.run_sync(on, second, lambda c: c.responses.retrieve(
                r1.id))  # fmt: skip
        assert r2.output_text == "Second."
        assert again.output_text == "First."


def _client_port(client: httpx.Client) -> int:
    """The client's port of its connection (opened by a GET /healthz, kept alive)."""
    response = client.get("/healthz")
    assert response.status_code == 200
    stream = response.extensions["network_stream"]
    port: int = stream.get_extra_info("client_addr")[1]
    return port


@asynccontextmanager
async def _edges_on_redis(
    tmp_path: Path, sim: SimProcess, redis: RedisServer
) -> AsyncIterator[tuple[EdgeProcess, EdgeProcess]]:
    toml = (
        f'[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
        f'[responses]\nstore = "redis"\nredis_url = "{redis.url}"\nredis_timeout_s = 1\n'
        "max_response_bytes = 8192\n"
    )
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(edge_process(tmp_path, toml, name="edge-a"))
        b = await stack.enter_async_context(edge_process(tmp_path, toml, name="edge-b"))
        yield a, b


async def test_two_edges_share_responses_through_redis(
    tmp_path: Path, sim: SimProcess, redis_server: RedisServer
) -> None:
    """Two edges on one real Redis: a response stored through one is continued, read and
    deleted through the other. References past `max_response_bytes` are a 413 naming
    the bound. Redis gone: a new response is still answered (its write failing is
    counted), and a continuation is a 503 saying to resend the items."""
    async with _edges_on_redis(tmp_path, sim, redis_server) as (a, b):
        long = [await _call(a.url, lambda c, n=n: c.responses.create(
            model="sim-echo", input=str(n) * 2000)) for n in range(4)]  # fmt: skip
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as http:
            body = {"model": "sim-echo", "previous_response_id": long[3].id,
                    "input": [{"type": "item_reference", "id": r.output[0].id}
                              for r in long[:3]]}  # fmt: skip
            over = await http.post(RESPONSES, json=body)
        assert over.status_code == 413, over.text
        assert over.json()["error"]["code"] == "references_too_large"
        assert "8192 bytes" in over.json()["error"]["message"]
        r1 = await _call(a.url, lambda c: c.responses.create(model="sim-script", input=TURNS))
        r2 = await _call(b.url, lambda c: c.responses.create(
            model="sim-script", input="go on", previous_response_id=r1.id))  # fmt: skip
        assert r2.output_text == "Second."
        assert (await _call(a.url, lambda c: c.responses.retrieve(r2.id))).output_text == "Second."
        await _call(b.url, lambda c: c.responses.delete(r1.id))
        with pytest.raises(openai.NotFoundError):
            await _call(a.url, lambda c: c.responses.retrieve(r1.id))
        redis_server.stop()
        answered = await _call(a.url, lambda c: c.responses.create(model="sim-echo", input="hi"))
        assert answered.output_text == "hi"
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as http:
            body = {"model": "sim-script", "input": "x", "previous_response_id": r2.id}
            down = await http.post(RESPONSES, json=body)
            metrics = (await http.get("/metrics")).text
        assert down.status_code == 503
        assert down.json()["error"]["type"] == "service_unavailable"
        assert "send the conversation's items" in down.json()["error"]["message"]
        assert total(metrics, "iop_edge_responses_stored_total", result="failed") == 1


@pytest.mark.parametrize("store", ["sqlite", "redis"])
async def test_a_key_past_its_quota_evicts_only_its_own(
    tmp_path: Path, sim: SimProcess, redis_server: RedisServer, store: str
) -> None:
    """Keys are tenants of the store: key b storing past `per_key_max_responses` loses
    its own oldest responses, never key a's (one left in a store with room for eight),
    and each plain `[server] api_keys` entry is a tenant of its own: one cannot read
    what the other stored."""
    where = (
        f'store = "redis"\nredis_url = "{redis_server.url}"\nkey_prefix = "quota:"\n'
        if store == "redis"
        else f'path = "{tmp_path / "responses.sqlite3"}"\n'
    )
    toml = (
        '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\napi_keys = ["sk-p1", "sk-p2"]\n'
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
        '[[keys]]\nname = "team-a"\nkey = "sk-a"\n[[keys]]\nname = "team-b"\nkey = "sk-b"\n'
        f"[responses]\n{where}max_responses = 8\nper_key_max_responses = 2\n"
    )
    async with edge_process(tmp_path, toml, name=f"edge-{store}") as edge:
        a1 = await _call(edge.url, lambda c: c.responses.create(
            model="sim-echo", input="a's own"), key="sk-a")  # fmt: skip
        b = [await _call(edge.url, lambda c, i=i: c.responses.create(
            model="sim-echo", input=f"b {i}"), key="sk-b") for i in range(5)]  # fmt: skip
        kept = await _call(edge.url, lambda c: c.responses.retrieve(a1.id), key="sk-a")
        assert kept.output_text == "a's own"
        for gone in b[:3]:
            with pytest.raises(openai.NotFoundError):
                await _call(edge.url, lambda c, r=gone: c.responses.retrieve(r.id), key="sk-b")
        for left in b[3:]:
            assert (await _call(edge.url, lambda c, r=left: c.responses.retrieve(r.id),
                                key="sk-b")).id == left.id  # fmt: skip
        p1 = await _call(edge.url, lambda c: c.responses.create(
            model="sim-echo", input="p1's"), key="sk-p1")  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            await _call(edge.url, lambda c: c.responses.retrieve(p1.id), key="sk-p2")
        assert (await _call(edge.url, lambda c: c.responses.retrieve(p1.id), key="sk-p1")).id
