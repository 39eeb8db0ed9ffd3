"""End to end: a run's start gives its node slot back on every path, and a large
request never holds the event loop.

A real edge in front of a real `iop-sim-node`, over real sockets. The node allows
`max_runs = 2`: a slot that never came back would turn every later request into a
503 `overloaded` after two leaks, so each case ends with the node's `in_flight`
back at 0 and a valid request served.

- Bodies nested 975 levels deep in a free-form field of each API (a content part,
  `response_format`, `chat_template_kwargs`, a document, a tool_result, an
  `input_file`) once passed the parser and raised RecursionError while the
  RunRequest was built, on the loop and before the run's cleanup was armed: a 500
  and a slot leaked for good. They are a 400 naming the depth limit.
- Every step of a run's start that fails for real (the node client's start, the
  accept wait, the first batch, the caller leaving in each) gives the slot back.
- Hundreds of thousands of tiny content parts (under every per-message limit) are
  a 400 naming the value limit; a large request within the limits is served while
  `/healthz` keeps answering.
- The RunRequest is serialized once per request; each attempt's node deadline is
  appended to it, and a node reads that deadline.
- A request of at most INLINE_BYTES is prepared on the event loop's thread (a
  hand-off to a thread and back would cost its first token more than the work);
  a larger one in a worker thread.

Waits are bounded polls on in-process state; nothing asserts a duration.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.api.request import TOO_DEEP, TOO_MANY_VALUES
from edge.config import Config, NodeConfig, RoutingConfig, ServerConfig, TimeoutsConfig
from edge.fleet.run import NODE_DEADLINE_GRACE_S
from edge.http.chat import INLINE_BYTES
from edge.stream import bounds
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    named_sims,
    poll,
    script,
    start_edge,
    start_sim,
    stop_edge,
    stop_process,
)

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
WAIT_S = 20.0
COMPLETE = {"type": "complete", "metadata": {"finish_reason": "stop"}}
# Where a body holds 975 nested arrays (spliced into its JSON text): under the JSON
# decoder's own recursion limit, over Python's in the walks that build a RunRequest.
DEEP = "<deep>"
DEEP_JSON = "[" * 975 + "]" * 975


def _config(sim: SimProcess, *extra: SimProcess, **timeouts: float) -> Config:
    names = ("sim", "b")
    return Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0, node_refresh_s=600),
        timeouts=replace(TimeoutsConfig(), **timeouts),
        routing=RoutingConfig(retries=1, retry_backoff_s=0.01),
        nodes=tuple(
            NodeConfig(name, node.address, max_runs=2)
            for name, node in zip(names, (sim, *extra), strict=False)
        ),
    )


def _in_flight(edge: RunningEdge) -> int:
    return sum(state.in_flight for state in edge.edge.pool.nodes)


async def _served(edge: RunningEdge, http: httpx.AsyncClient) -> None:
    """Every slot is back, and a valid request is answered in full."""
    await poll(lambda: _in_flight(edge) == 0)
    response = await http.post(CHAT, json=chat_body("sim-echo", "still serving"))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "still serving"


@pytest.fixture
async def edge(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[RunningEdge]:
    running = await start_edge(nursery, _config(sim))
    yield running
    await stop_edge(running)


@pytest.fixture
async def short(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[RunningEdge]:
    """An edge whose node has 1 s to accept a run and send its first event."""
    running = await start_edge(nursery, _config(sim, first_event_s=1.0))
    yield running
    await stop_edge(running)


async def _post(http: httpx.AsyncClient, path: str, body: bytes) -> httpx.Response:
    return await http.post(path, content=body, headers={"content-type": "application/json"})


def _error(response: httpx.Response, path: str) -> dict[str, Any]:
    """The error object of `response`, in the API's own shape."""
    body = response.json()
    if path == MESSAGES:
        assert body["type"] == "error"
    return dict(body["error"])


# --- bodies nested too deeply -------------------------------------------------------


def _chat_part() -> dict[str, Any]:
    return {"model": "sim-echo", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"},
                                     {"type": "input_audio", "input_audio": DEEP}]}]}  # fmt: skip


_NESTED: dict[str, tuple[str, dict[str, Any]]] = {
    "chat non-text content part": (CHAT, _chat_part()),
    "chat response_format extra": (CHAT, chat_body(
        "sim-echo", "hi", response_format={"type": "json_object", "extra": DEEP})),
    "chat chat_template_kwargs": (CHAT, chat_body(
        "sim-echo", "hi", chat_template_kwargs={"x": DEEP})),
    "messages document": (MESSAGES, {"model": "sim-echo", "max_tokens": 16, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {
            "type": "document", "source": {"type": "content", "content": DEEP}}]}]}),
    "messages tool_result": (MESSAGES, {"model": "sim-echo", "max_tokens": 16, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"type": "x", "y": DEEP}]},
                                     {"type": "text", "text": "hi"}]}]}),
    "responses input_file": (RESPONSES, {"model": "sim-echo", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                     {"type": "input_file", "file_data": DEEP}]}]}),
}  # fmt: skip


def _nested_body(obj: dict[str, Any]) -> bytes:
    text = json.dumps(obj)
    assert text.count(json.dumps(DEEP)) == 1
    return text.replace(json.dumps(DEEP), DEEP_JSON).encode()


@pytest.mark.parametrize("case", sorted(_NESTED))
async def test_a_nested_body_is_a_400_and_leaves_no_slot_taken(
    edge: RunningEdge, http: httpx.AsyncClient, case: str
) -> None:
    """Four bodies nested 975 levels deep in a free-form field (twice the node's
    max_runs) each get a 400 naming the depth limit, in the API's error shape; no
    slot stays taken, and a valid request is served afterwards."""
    path, obj = _NESTED[case]
    body = _nested_body(obj)
    for _ in range(4):
        response = await _post(http, path, body)
        assert response.status_code == 400, response.text
        error = _error(response, path)
        assert error["type"] == "invalid_request_error"
        assert error["message"] == TOO_DEEP
        assert str(bounds.MAX_JSON_DEPTH) in error["message"]
    assert _in_flight(edge) == 0
    await _served(edge, http)


# --- every step of a run's start -------------------------------------------------------


def _huge_part_body() -> dict[str, Any]:
    """Under the body limit as UTF-8, over the nodes' gRPC limit as a RunRequest (the
    part goes to the node as JSON with its non-ASCII characters escaped: 3 -> 6 bytes)."""
    audio = {"type": "input_audio", "input_audio": {"data": "\u4e2d" * 1_300_000}}
    content = [{"type": "text", "text": "hi"}, audio]
    return {"model": "sim-echo", "messages": [{"role": "user", "content": content}]}


# (what fails, the request, the status it gets)
_FAILURES: dict[str, tuple[dict[str, Any], int]] = {
    "start: over the node's message limit": (_huge_part_body(), 413),
    "accept wait: the accept never comes": (
        chat_body("sim-script", script({"accept_after_ms": 30_000}, COMPLETE)), 504),
    "first batch: an error event": (
        chat_body("sim-script", script({"type": "error", "error": "boom"})), 502),
    "first batch: the stream breaks": (chat_body("sim-script", script({"type": "abort"})), 502),
    "first batch: no first event": (chat_body("sim-script", script({"type": "hang"})), 504),
    "first batch, streamed: no first event": (
        chat_body("sim-script", script({"type": "hang"}), stream=True), 504),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_FAILURES))
async def test_a_run_start_that_fails_gives_its_slot_back(short: RunningEdge, case: str) -> None:
    """Runs that fail at a step of their start (the node client's start, the accept
    wait, the first batch), three at once on a node of max_runs 2 (the third waits for
    a slot to come back), each get their error status (never a 500), and every slot
    comes back."""
    body, status = _FAILURES[case]
    encoded = json.dumps(body, ensure_ascii=False).encode()
    assert len(encoded) < ServerConfig().max_body_bytes
    statuses: list[int] = []

    async def one(http: httpx.AsyncClient) -> None:
        response = await _post(http, CHAT, encoded)
        assert _error(response, CHAT)["message"]
        statuses.append(response.status_code)

    async with httpx.AsyncClient(base_url=short.url, timeout=30) as http:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one, http)
        assert statuses == [status] * 3
        await _served(short, http)


# (where the caller leaves, the request)
_LEAVES: dict[str, dict[str, Any]] = {
    "accept wait": chat_body("sim-script", script({"accept_after_ms": 30_000}, COMPLETE)),
    "first batch": chat_body("sim-script", script({"type": "hang"})),
    "first batch, streamed": chat_body("sim-script", script({"type": "hang"}), stream=True),
}


@pytest.mark.parametrize("case", sorted(_LEAVES))
async def test_a_caller_that_leaves_during_a_run_start_gives_its_slot_back(
    edge: RunningEdge, http: httpx.AsyncClient, case: str
) -> None:
    """Callers that leave while their runs start (both slots taken, the runs started:
    the node holds the accept back, or accepted and sends no first event) give both
    slots back; a valid request is served afterwards."""
    body = _LEAVES[case]
    accepted = case != "accept wait"
    live = edge.edge.runs.live

    def started() -> bool:
        return len(live) == 2 and all(run.accepted == accepted for run in live)

    with trio.CancelScope() as callers:
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(partial(http.post, CHAT, json=body))
            await poll(started)
            assert _in_flight(edge) == 2
            callers.cancel()
    await _served(edge, http)


async def test_a_node_gone_at_the_start_gives_the_slot_back(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The node's process is gone when the run starts (the edge still thinks it up):
    the start fails unreachable (503 node_unavailable) and the slot comes back."""
    node = start_sim(tmp_path, "gone")
    running = await start_edge(nursery, _config(node))
    try:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            assert (await http.post(CHAT, json=chat_body("sim-echo", "hi"))).status_code == 200
            stop_process(node.process)
            response = await http.post(CHAT, json=chat_body("sim-echo", "hi"))
            assert response.status_code == 503, response.text
            assert _error(response, CHAT)["type"] == "node_unavailable"
            assert _in_flight(running) == 0
    finally:
        stop_process(node.process)
        await stop_edge(running)


# --- large requests ------------------------------------------------------------------


def _tiny_parts_body(parts: int) -> bytes:
    """`parts` content parts of a few bytes each, MAX_CONTENT_PARTS to a message."""
    per = bounds.MAX_CONTENT_PARTS
    messages = [
        {"role": "user", "content": [{"type": ""}] * min(per, parts - start)}
        for start in range(0, parts, per)
    ]
    messages.append({"role": "user", "content": "the end"})
    return json.dumps({"model": "sim-echo", "messages": messages}, separators=(",", ":")).encode()


async def test_many_tiny_content_parts_are_a_400_naming_the_limit(
    edge: RunningEdge, http: httpx.AsyncClient
) -> None:
    """325,000 tiny content parts, under the body limit and every per-message limit, are
    one 400 naming the value limit: refused where the body is decoded."""
    body = _tiny_parts_body(325_000)
    assert len(body) < ServerConfig().max_body_bytes
    response = await _post(http, CHAT, body)
    assert response.status_code == 400, response.text
    assert _error(response, CHAT)["message"] == TOO_MANY_VALUES
    await _served(edge, http)


def _many_messages_body(count: int) -> bytes:
    messages = [{"role": "user" if i % 2 else "assistant", "content": "m"} for i in range(count)]
    messages.append({"role": "user", "content": "the end"})
    return json.dumps({"model": "sim-echo", "messages": messages}, separators=(",", ":")).encode()


def _tool_history_body(size: int) -> bytes:
    """A history of tool calls and results, about `size` bytes."""
    arguments = json.dumps({"text": "x" * 2000})
    messages: list[dict[str, Any]] = []
    i = 0
    while i * 2200 < size:
        call = {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "f", "arguments": arguments},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"})
        i += 1
    messages.append({"role": "user", "content": "the end"})
    return json.dumps({"model": "sim-echo", "messages": messages}, separators=(",", ":")).encode()


def _small_calls_body(size: int) -> bytes:
    """Assistant messages of MAX_MESSAGE_TOOL_CALLS small tool calls each, about `size`
    bytes of calls in all (a value per few bytes, within MAX_JSON_VALUES)."""
    messages: list[dict[str, Any]] = []
    total = 0
    while total < size:
        function = {"name": "f", "arguments": "{}"}
        calls = [{"id": f"c{len(messages)}-{j}", "type": "function", "function": function}
                 for j in range(bounds.MAX_MESSAGE_TOOL_CALLS)]  # fmt: skip
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        total += len(json.dumps(calls, separators=(",", ":")))
    messages.append({"role": "user", "content": "the end"})
    return json.dumps({"model": "sim-echo", "messages": messages}, separators=(",", ":")).encode()


_LARGE: dict[str, Callable[[], bytes]] = {
    "16,000 messages": lambda: _many_messages_body(16_000),
    "130,000 tiny content parts": lambda: _tiny_parts_body(130_000),
    "a tool-call history of 3.5 MB": lambda: _tool_history_body(3_500_000),
    "3.8 MB of small history tool calls": lambda: _small_calls_body(3_800_000),
}


@pytest.mark.parametrize("case", sorted(_LARGE))
async def test_a_large_request_is_served_while_healthz_answers(
    edge: RunningEdge, http: httpx.AsyncClient, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request within every limit but large in values or bytes is answered in full,
    and /healthz, probed in a loop, is answered while that request is being prepared
    (parsed, checked, its RunRequest serialized): that work never holds the loop.
    (Answered before the big one alone would pass with the work on the loop: the first
    probe is answered while the body is still being sent.)"""
    body = _LARGE[case]()
    assert len(body) < ServerConfig().max_body_bytes
    chat = edge.edge.chat
    prepare = chat.prepare
    preparing = [0]  # prepares in progress, in their worker threads
    during: list[int] = []  # /healthz answers seen while one was in progress
    answered: list[str] = []

    def watched(*args: Any) -> Any:
        preparing[0] += 1
        try:
            return prepare(*args)
        finally:
            preparing[0] -= 1

    monkeypatch.setattr(chat, "prepare", watched)

    async def big() -> None:
        response = await _post(http, CHAT, body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "the end"
        answered.append("big")

    async def probe() -> None:
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as prober:
            while not answered:
                assert (await prober.get("/healthz")).status_code == 200
                if preparing[0]:
                    during.append(1)

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(big)
            nursery.start_soon(probe)
    print(f"{case}: /healthz answered {len(during)} times during the prepare")
    assert during, "no /healthz answer while the request was prepared"
    await _served(edge, http)


async def test_a_small_request_is_prepared_on_the_loop_a_larger_one_in_a_thread(
    edge: RunningEdge, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request of at most INLINE_BYTES is prepared (parsed, checked, its RunRequest
    serialized) on the event loop's thread, in its turn; one larger, in a worker
    thread. Both are answered."""
    chat = edge.edge.chat
    prepare = chat.prepare
    threads: list[int] = []

    def watched(*args: Any) -> Any:
        threads.append(threading.get_ident())
        return prepare(*args)

    monkeypatch.setattr(chat, "prepare", watched)
    small = json.dumps(chat_body("sim-echo", "small")).encode()
    large = json.dumps(chat_body("sim-echo", "x" * INLINE_BYTES)).encode()
    assert len(small) <= INLINE_BYTES < len(large)
    for body in (small, large):
        response = await _post(http, CHAT, body)
        assert response.status_code == 200, response.text
    assert threads[0] == threading.get_ident()  # the edge's loop runs the test's thread
    assert threads[1] != threading.get_ident()


# --- the node's deadline ------------------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[SimProcess, SimProcess]]:
    with named_sims(tmp_path, "sim", "b") as (a, b):
        yield a, b


async def test_each_attempt_sends_the_request_deadline(
    nursery: trio.Nursery, pair: tuple[SimProcess, SimProcess]
) -> None:
    """The RunRequest a node receives carries the request's total deadline as wall-clock
    milliseconds (NODE_DEADLINE_GRACE_S later: the edge's own timeout comes first), on
    the first attempt and on a retry on another node alike (the bytes serialized once,
    each attempt's deadline appended), and the rest of the request whole."""
    total_s = 30.0
    running = await start_edge(nursery, _config(*pair, total_s=total_s, first_event_s=5.0))
    content = script(
        {"on_node": "sim", "type": "error", "error": "boom"},
        {"on_node": "b", "type": "request"},
        COMPLETE,
    )
    try:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            # Whichever node the first attempt lands on, the answer is b's.
            seen = []
            for _ in range(2):
                before = time.time()
                response = await http.post(CHAT, json=chat_body("sim-script", content, seed=7))
                after = time.time()
                assert response.status_code == 200, response.text
                sent = json.loads(response.json()["choices"][0]["message"]["content"])
                seen.append(sent)
                deadline = int(sent["deadlineUnixMs"])
                limit_s = total_s + NODE_DEADLINE_GRACE_S
                assert (before + limit_s) * 1000 - 1000 <= deadline <= (after + limit_s) * 1000
                assert sent["model"] == "sim-script"
                assert sent["seed"] == "7"
                assert sent["messages"][0]["content"] == content
            await poll(lambda: _in_flight(running) == 0)
        retries = running.edge.metrics.registry.get_sample_value(
            "iop_edge_retries_total", {"node": "sim", "reason": "error_event"}
        )
        assert retries, "the first attempt failed on one node and the answer is another's"
    finally:
        await stop_edge(running)
    assert len(seen) == 2
