"""Fair share and service tiers over a real edge and a real node process.

The node takes one run at a time (`max_runs = 1`); a stream that hangs mid-answer
holds that slot while other requests queue, and gives it back when its client leaves.
Each rule of the fair queue is seen from outside: a tenant past its bound is shed and
the others are not; the bands are served strictly and flex is shed first (429); a
tier the key may not use is a 400; a queued client that leaves frees its tenant's
place; every API says the tier a request ran on, streamed or not, and the official
`openai` SDK's `service_tier` argument works; a slot kept for priority
(`priority_slots`) lets a priority request start at once beside a flood. Waits are
bounded polls on in-process state; nothing asserts a duration.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio
from loguru import logger

from edge.config import AdmissionConfig, Config, KeyConfig, NodeConfig, ServerConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    poll,
    script,
    sse_frames,
    start_edge,
    stop_edge,
)

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
WAIT_S = 20.0
ALL_TIERS = ("priority", "default", "flex")
KEYS = (
    KeyConfig("gold", "sk-gold", service_tiers=ALL_TIERS),
    KeyConfig("flood", "sk-flood"),
    KeyConfig("victim", "sk-victim"),
)
HOLD = chat_body("sim-script", script({"type": "delta", "delta": "x"}, {"type": "hang"}),
                 stream=True)  # fmt: skip


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def _edge(
    nursery: trio.Nursery, sim: SimProcess, *, max_runs: int = 1, **admission: Any
) -> RunningEdge:
    config = Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
        admission=AdmissionConfig(**{"queue_timeout_s": 60, **admission}),
        nodes=(NodeConfig("sim", sim.address, max_runs=max_runs),),
        keys=KEYS,
    )
    return await start_edge(nursery, config)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=WAIT_S) as http:
        yield http


async def _hold(http: httpx.AsyncClient, url: str, held: list[str]) -> None:
    """A stream mid-answer that keeps the one slot until cancelled (its client leaves)."""
    async with http.stream("POST", url + CHAT, json=HOLD, headers=_auth("sk-gold")) as response:
        async for line in response.aiter_lines():
            if '"content":"x"' in line:
                held.append(json.loads(line[6:])["id"])
                await trio.sleep_forever()


async def _held(
    nursery: trio.Nursery, http: httpx.AsyncClient, edge: RunningEdge
) -> trio.CancelScope:
    """The slot held; cancel the scope returned to give it back."""
    held: list[str] = []
    scope = trio.CancelScope()

    async def holder() -> None:
        with scope:
            await _hold(http, edge.url, held)

    nursery.start_soon(holder)
    await poll(lambda: len(held) == 1)
    return scope


def _queued(
    nursery: trio.Nursery,
    http: httpx.AsyncClient,
    edge: RunningEdge,
    secret: str,
    tag: str,
    answers: list[tuple[str, httpx.Response]],
    tier: str | None = None,
) -> None:
    """A request of `secret`'s key (asking for `tier`) whose answer joins `answers`."""
    extra = {} if tier is None else {"service_tier": tier}

    async def send() -> None:
        body = chat_body("sim-echo", tag, **extra)
        answers.append((tag, await http.post(edge.url + CHAT, json=body, headers=_auth(secret))))

    nursery.start_soon(send)


def _sample(edge: RunningEdge, name: str, **labels: str) -> float:
    return edge.edge.metrics.registry.get_sample_value(name, labels) or 0.0


class _ShedLines:
    """The fields of each request line the edge logs for a request it shed (429, 503)."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []
        self._id = logger.add(self._sink, level="INFO", format="{message}")

    def _sink(self, message: Any) -> None:
        extra = message.record["extra"]
        if message.record["message"].startswith("POST /v1/") and extra.get("status") in (
            429, 503,
        ):  # fmt: skip
            self.lines.append(dict(extra))

    def close(self) -> list[dict[str, Any]]:
        logger.remove(self._id)
        return self.lines


async def test_a_tenant_past_its_bound_is_shed_and_the_others_are_not(
    nursery: trio.Nursery, node: SimProcess, client: httpx.AsyncClient
) -> None:
    """max_queue_per_key 2: the flood's third waiting request is answered 503 overloaded
    at once, the victim's still queues and is served before the flood's second; /readyz
    and the metrics show the queue by tier and the flood's requests waiting."""
    edge = await _edge(nursery, node, max_queue=10, max_queue_per_key=2)
    admission = edge.edge.admission
    answers: list[tuple[str, httpx.Response]] = []
    lines = _ShedLines()
    async with trio.open_nursery() as waiting:
        holder = await _held(waiting, client, edge)
        for i in range(2):
            _queued(waiting, client, edge, "sk-flood", f"flood{i}", answers)
            await poll(lambda i=i: admission.depth == i + 1)
        shed = await client.post(
            edge.url + CHAT, json=chat_body("sim-echo", "flood2"), headers=_auth("sk-flood")
        )
        assert shed.status_code == 503, shed.text
        assert shed.json()["error"]["code"] == "overloaded"
        assert int(shed.headers["Retry-After"]) >= 1
        _queued(waiting, client, edge, "sk-victim", "victim", answers)
        await poll(lambda: admission.depth == 3)
        ready = (await client.get(edge.url + "/readyz")).json()
        assert ready["queue"] == {
            "policy": "fair", "depth": 3, "priority": 0, "default": 3, "flex": 0,
        }  # fmt: skip
        assert _sample(edge, "iop_edge_key_queued", key="flood") == 2
        assert _sample(edge, "iop_edge_queue_depth", tier="default") == 3
        holder.cancel()
    assert [tag for tag, _ in answers] == ["flood0", "victim", "flood1"]
    assert all(r.status_code == 200 for _, r in answers)
    assert _sample(edge, "iop_edge_shed_total", reason="key_full", tier="unknown") == 1
    assert [(line["key"], line["status"]) for line in lines.close()] == [("flood", 503)]
    await stop_edge(edge)


async def test_tiers_dispatch_strictly_and_flex_is_shed_first(
    nursery: trio.Nursery, node: SimProcess, client: httpx.AsyncClient
) -> None:
    """A full queue of three: a newcomer displaces the waiting flex request, which is
    answered 429 rate_limit_exceeded with Retry-After; then the slot goes to priority,
    default, then the rest, whatever the order they came in."""
    edge = await _edge(nursery, node, max_queue=3, max_queue_per_key=3)
    admission = edge.edge.admission
    answers: list[tuple[str, httpx.Response]] = []
    lines = _ShedLines()
    async with trio.open_nursery() as waiting:
        holder = await _held(waiting, client, edge)
        for n, (tag, tier) in enumerate([("flex", "flex"), ("default", None),
                                         ("priority", "priority")], 1):  # fmt: skip
            _queued(waiting, client, edge, "sk-gold", tag, answers, tier)
            await poll(lambda n=n: admission.depth == n)
        _queued(waiting, client, edge, "sk-victim", "victim", answers)
        await poll(lambda: len(answers) == 1)
        tag, flex = answers[0]
        assert tag == "flex"
        assert flex.status_code == 429, flex.text
        assert flex.json()["error"]["type"] == flex.json()["error"]["code"]
        assert flex.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(flex.headers["Retry-After"]) >= 1
        await poll(lambda: admission.depth == 3)
        holder.cancel()
    assert [tag for tag, _ in answers[1:]] == ["priority", "default", "victim"]
    assert [r.json()["service_tier"] for _, r in answers[1:]] == [
        "priority", "default", "default",
    ]  # fmt: skip
    assert _sample(edge, "iop_edge_shed_total", reason="queue_full", tier="flex") == 1
    assert [(line["key"], line["tier"], line["status"]) for line in lines.close()] == [
        ("gold", "flex", 429),
    ]  # fmt: skip
    await stop_edge(edge)


async def test_a_kept_slot_lets_a_priority_request_start_at_once_beside_a_flood(
    nursery: trio.Nursery, node: SimProcess, client: httpx.AsyncClient
) -> None:
    """priority_slots 1 on a node of 2: with one slot held, the flood's default requests
    queue beside the free one; a priority request takes it at once and is answered while
    they wait; they run once the held slot is given back."""
    edge = await _edge(nursery, node, max_runs=2, priority_slots=1)
    admission = edge.edge.admission
    answers: list[tuple[str, httpx.Response]] = []
    async with trio.open_nursery() as waiting:
        holder = await _held(waiting, client, edge)
        for n in (1, 2):
            _queued(waiting, client, edge, "sk-flood", f"flood{n}", answers)
            await poll(lambda n=n: admission.depth == n)
        _queued(waiting, client, edge, "sk-gold", "priority", answers, "priority")
        await poll(lambda: len(answers) == 1)
        assert admission.depth == 2
        holder.cancel()
    assert [(tag, r.status_code) for tag, r in answers] == [
        ("priority", 200), ("flood1", 200), ("flood2", 200),
    ]  # fmt: skip
    assert answers[0][1].json()["service_tier"] == "priority"
    assert _sample(edge, "iop_edge_queue_wait_seconds_count", tier="priority") == 0
    await stop_edge(edge)


async def test_a_tier_the_key_may_not_use_is_a_400_naming_it(
    nursery: trio.Nursery, sim: SimProcess, client: httpx.AsyncClient
) -> None:
    edge = await _edge(nursery, sim)
    for path, body in (
        (CHAT, chat_body("sim-echo", "hi", service_tier="priority")),
        (RESPONSES, {"model": "sim-echo", "input": "hi", "service_tier": "priority"}),
    ):
        refused = await client.post(edge.url + path, json=body, headers=_auth("sk-victim"))
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "service_tier"
        assert "'priority'" in error["message"]
    allowed = await client.post(
        edge.url + CHAT, json=chat_body("sim-echo", "hi", service_tier="priority"),
        headers=_auth("sk-gold"),
    )  # fmt: skip
    assert allowed.status_code == 200
    await stop_edge(edge)


async def test_a_queued_request_whose_client_leaves_frees_its_place(
    nursery: trio.Nursery, node: SimProcess, client: httpx.AsyncClient
) -> None:
    """At its bound of one, the flood's waiting client hangs up: its next request
    queues (not shed), and no run is ever started for the one that left."""
    edge = await _edge(nursery, node, max_queue=10, max_queue_per_key=1)
    admission = edge.edge.admission
    answers: list[tuple[str, httpx.Response]] = []
    async with trio.open_nursery() as waiting:
        holder = await _held(waiting, client, edge)
        async with trio.open_nursery() as leaver:
            _queued(leaver, client, edge, "sk-flood", "leaves", answers)
            await poll(lambda: admission.depth == 1)
            leaver.cancel_scope.cancel()
        await poll(lambda: admission.depth == 0)
        _queued(waiting, client, edge, "sk-flood", "next", answers)
        await poll(lambda: admission.depth == 1)
        holder.cancel()
    assert [(tag, r.status_code) for tag, r in answers] == [("next", 200)]
    assert _sample(edge, "iop_edge_shed_total", reason="key_full", tier="default") == 0
    await stop_edge(edge)


def _messages_body(**extra: Any) -> dict[str, Any]:
    return {"model": "sim-echo", "max_tokens": 20,
            "messages": [{"role": "user", "content": "hi"}], **extra}  # fmt: skip


async def test_every_api_says_the_tier_streamed_or_not(
    nursery: trio.Nursery, sim: SimProcess, client: httpx.AsyncClient
) -> None:
    """Chat completions (the completion, each chunk), Responses (the Response, its
    snapshots), Messages (the usage: Anthropic's words) say the tier the request ran
    on: the one asked for, or the key's default."""
    edge = await _edge(nursery, sim)
    gold = _auth("sk-gold")
    for stream in (False, True):
        chat = await client.post(
            edge.url + CHAT, json=chat_body("sim-echo", "hi", service_tier="flex", stream=stream),
            headers=gold,
        )  # fmt: skip
        assert chat.status_code == 200, chat.text
        if stream:
            frames = sse_frames(chat.text)
            assert frames
            assert {f["service_tier"] for f in frames} == {"flex"}
        else:
            assert chat.json()["service_tier"] == "flex"
        body = {"model": "sim-echo", "input": "hi", "service_tier": "priority", "stream": stream}
        response = await client.post(edge.url + RESPONSES, json=body, headers=gold)
        assert response.status_code == 200, response.text
        if stream:
            snapshots = [f["response"] for f in sse_frames(response.text) if "response" in f]
            assert {s["service_tier"] for s in snapshots} == {"priority"}
        else:
            assert response.json()["service_tier"] == "priority"
        message = await client.post(
            edge.url + MESSAGES, json=_messages_body(service_tier="standard_only", stream=stream),
            headers=gold,
        )  # fmt: skip
        assert message.status_code == 200, message.text
        if stream:
            start = next(f for f in sse_frames(message.text) if f["type"] == "message_start")
            assert start["message"]["usage"]["service_tier"] == "standard"
        else:
            assert message.json()["usage"]["service_tier"] == "standard"
    default = await client.post(
        edge.url + CHAT, json=chat_body("sim-echo", "hi"), headers=_auth("sk-victim")
    )
    assert default.json()["service_tier"] == "default"
    await stop_edge(edge)


async def test_the_openai_sdks_service_tier_argument(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """`service_tier=` of the official SDK: the tier comes back typed on the completion,
    each chunk and the Response; one the key may not use is a BadRequestError."""
    edge = await _edge(nursery, sim)

    def use_sdk() -> None:
        sdk = openai.OpenAI(base_url=edge.url + "/v1", api_key="sk-gold", max_retries=0)
        messages: Any = [{"role": "user", "content": "hi"}]
        with sdk:
            done = sdk.chat.completions.create(
                model="sim-echo", messages=messages, service_tier="flex"
            )
            assert done.service_tier == "flex"
            chunks = list(
                sdk.chat.completions.create(
                    model="sim-echo", messages=messages, service_tier="priority", stream=True
                )
            )
            assert chunks
            assert {chunk.service_tier for chunk in chunks} == {"priority"}
            response = sdk.responses.create(model="sim-echo", input="hi", service_tier="auto")
            assert response.service_tier == "default"
        other = openai.OpenAI(base_url=edge.url + "/v1", api_key="sk-victim", max_retries=0)
        with other, pytest.raises(openai.BadRequestError) as refused:
            other.chat.completions.create(
                model="sim-echo", messages=messages, service_tier="priority"
            )
        assert refused.value.body["param"] == "service_tier"  # type: ignore[index]

    await trio.to_thread.run_sync(use_sdk)
    await stop_edge(edge)
