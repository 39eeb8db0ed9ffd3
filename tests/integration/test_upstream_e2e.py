"""End to end: `iop-node` in front of real HTTP upstreams.

Two upstreams, both real sockets on 127.0.0.1:

- an `iop-edge` serving the simulated node is itself an OpenAI-compatible
  server, so `openai SDK -> iop-edge B -> iop-node (a process) -> iop-edge A ->
  iop-sim-node (a process)` goes over real HTTP, gRPC and SSE at every hop,
  cancellation included;
- a small replay server plays the recorded chunk streams of vLLM, llama.cpp,
  Ollama and SGLang (tests/integration/upstream_fixtures), and the error
  bodies and broken streams those servers produce, to an edge whose node
  address is `openai+http://...` (the adapter in-process).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import h11
import httpx
import openai
import pytest
import trio

from edge.config import Config, NodeConfig, RoutingConfig, ServerConfig, TimeoutsConfig
from edge.contract._proto.iop.node import v1 as pb
from edge.errors import EdgeError
from edge.node.bridge import asyncio_loop
from edge.node.client import GrpcNodeClient, NodeSocket
from edge.nodes.direct import INLINE_BYTES
from edge.nodes.embedded import embedded_upstream_node
from edge.nodes.upstream.relay import OFFLOAD_CHARS
from edge.stream.events import Complete, Delta, Failed, NodeEvent
from tests.integration.conftest import (
    WEATHER_TOOL,
    RunningEdge,
    SimProcess,
    node_events,
    poll,
    script,
    stalled_stream,
    start_edge,
    start_upstream_node,
    stop_edge,
    stop_process,
)
from tests.integration.rawhttp import read_request, send_events, serve_upstream
from tests.integration.test_nodes_e2e import cancel_while_reading

FIXTURES = Path(__file__).parent / "upstream_fixtures"
WAIT_S = 10.0


# --- the replay upstream -----------------------------------------------------------


@dataclass
class Upstream:
    """A replaying OpenAI-compatible server: model NAME plays upstream_fixtures/NAME.*.

    `NAME.sse` is streamed one event per write; `NAME.STATUS.json` is an error
    answer. Three models are built in: `hang` sends one delta and then waits for
    the client to go away (setting `hung_up`); `abort` sends one delta and cuts
    the connection mid-body; `burst` sends BURST one-word chunks in one write
    (a server that streamed faster than its reader read), then `[DONE]`; `big`
    streams one chunk of BIG characters of content (in writes of 16 KiB), then
    `[DONE]`; `big-whole` answers the same content as one JSON completion;
    `silent` answers nothing, not even headers, until the client goes away
    (setting `hung_up`).
    """

    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    # The headers of each request to /chat/completions (names in lower case).
    headers: list[dict[str, str]] = field(default_factory=list)
    hung_up: trio.Event = field(default_factory=trio.Event)

    def models(self) -> list[str]:
        names = {
            p.name.split(".")[0]
            for p in FIXTURES.iterdir()
            if p.suffix in (".sse", ".json", ".html")
        }
        return sorted(names | {"hang", "abort", "burst", "big", "big-whole", "silent"})


# The chunks `burst` writes at once; the characters of `big`'s content.
BURST = 20
BIG = 300_000


def _big_content() -> str:
    return "".join(f"{i:06d} " for i in range(BIG // 7)).ljust(BIG, "x")


def _chunk(content: str) -> bytes:
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}}],
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


def _whole_response(status: int, body: bytes, kind: str = "application/json") -> list[Any]:
    headers = [("content-type", kind), ("content-length", str(len(body)))]
    return [h11.Response(status_code=status, headers=headers), h11.Data(body), h11.EndOfMessage()]


async def _respond(
    upstream: Upstream, stream: trio.SocketStream, conn: h11.Connection, target: bytes, body: bytes
) -> bool:
    """Answer one request; False when the connection must close."""
    if target == b"/v1/models":
        data = [{"id": m, "object": "model", "owned_by": "replay"} for m in upstream.models()]
        await send_events(
            stream,
            conn,
            *_whole_response(200, json.dumps({"object": "list", "data": data}).encode()),
        )
        return True
    if target == b"/metrics":  # iop-node reads the load of its upstream: none here
        await send_events(stream, conn, *_whole_response(404, b"Not Found", "text/plain"))
        return True
    doc = json.loads(body)
    upstream.requests.append(doc)
    model = doc["model"]
    sse_head = h11.Response(status_code=200, headers=[("content-type", "text/event-stream")])
    if model == "silent":
        with trio.fail_after(WAIT_S):
            while await stream.receive_some(65536):
                pass
        upstream.hung_up.set()
        return False
    if model in ("hang", "abort"):
        await send_events(stream, conn, sse_head, h11.Data(_chunk("x")))
        if model == "abort":
            return False  # closed with the chunked body unfinished
        with trio.fail_after(WAIT_S):
            while await stream.receive_some(65536):
                pass
        upstream.hung_up.set()
        return False
    if model == "big":
        event = _chunk(_big_content())
        await send_events(stream, conn, sse_head)
        for at in range(0, len(event), 16 * 1024):
            await send_events(stream, conn, h11.Data(event[at : at + 16 * 1024]))
        await send_events(stream, conn, h11.Data(b"data: [DONE]\n\n"), h11.EndOfMessage())
        return True
    if model == "big-whole":
        answer = {
            "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": _big_content()}}],
        }  # fmt: skip
        await send_events(stream, conn, *_whole_response(200, json.dumps(answer).encode()))
        return True
    if model == "burst":
        words = b"".join(_chunk(f"w{i} ") for i in range(BURST))
        await send_events(stream, conn, sse_head, h11.Data(words))
        await send_events(stream, conn, h11.Data(b"data: [DONE]\n\n"), h11.EndOfMessage())
        return True
    sse = FIXTURES / f"{model}.sse"
    if sse.exists():
        await send_events(stream, conn, sse_head)
        for event in sse.read_text().split("\n\n")[:-1]:
            await send_events(stream, conn, h11.Data((event + "\n\n").encode()))
        await send_events(stream, conn, h11.EndOfMessage())
        return True
    for path in FIXTURES.glob(f"{model}.*.*"):
        status = int(path.name.split(".")[1])
        kind = "application/json" if path.suffix == ".json" else "text/html"
        await send_events(stream, conn, *_whole_response(status, path.read_bytes(), kind))
        return True
    missing = json.dumps({"error": {"message": f"no model {model}"}}).encode()
    await send_events(stream, conn, *_whole_response(404, missing))
    return True


async def _connection(upstream: Upstream, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    async with stream:
        try:
            while (received := await read_request(stream, conn)) is not None:
                request, body = received
                if request.target.endswith(b"/chat/completions"):
                    upstream.headers.append({k.decode(): v.decode() for k, v in request.headers})
                if not await _respond(upstream, stream, conn, request.target, body):
                    return
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, h11.ProtocolError):
            return


@pytest.fixture
async def upstream(nursery: trio.Nursery) -> Upstream:
    replay = Upstream()
    replay.url = await serve_upstream(nursery, partial(_connection, replay))
    return replay


def _edge_config(*nodes: NodeConfig) -> Config:
    return Config(server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0), nodes=nodes)


@pytest.fixture
async def replay_edge(nursery: trio.Nursery, upstream: Upstream) -> AsyncIterator[RunningEdge]:
    running = await start_edge(
        nursery, _edge_config(NodeConfig("replay", f"openai+{upstream.url}"))
    )
    yield running
    await stop_edge(running)


def _chat(model: str, content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def _sse_payloads(raw: bytes) -> list[Any]:
    out = []
    for frame in raw.decode().split("\n\n"):
        if frame.startswith("data: ") and frame != "data: [DONE]":
            out.append(json.loads(frame.removeprefix("data: ")))
    return out


# --- the dialects, in-process (`openai+http://`) ------------------------------------


@pytest.mark.parametrize(
    ("model", "content", "reasoning", "calls", "usage"),
    [
        (
            "vllm",
            None,
            "The user wants the weather in Paris and Tokyo.",
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})],
            (181, 55, 160, 0),
        ),
        ("llamacpp", "Hello! How can I help?", "A greeting. Answer briefly.", [], (24, 12, 16, 0)),
        (
            "ollama",
            None,
            "I should call the weather tool.",
            [("get_weather", {"city": "Paris"})],
            (0, 0, 0, 0),
        ),
        (
            "sglang",
            "Checking Paris.",
            "Celsius is expected.",
            [("get_weather", {"city": "Paris", "unit": "celsius"})],
            (210, 52, 0, 9),
        ),
    ],
)
async def test_dialect_through_the_edge(
    replay_edge: RunningEdge,
    upstream: Upstream,
    model: str,
    content: str | None,
    reasoning: str,
    calls: list[tuple[str, dict[str, Any]]],
    usage: tuple[int, int, int, int],
) -> None:
    """Each server's recorded stream reaches the caller as one correct chat.completion,
    and the upstream was asked to stream with usage, with the caller's tools and sampling."""
    body = _chat(model, tools=[WEATHER_TOOL], temperature=0.5, max_tokens=99, seed=3, top_k=20)
    async with httpx.AsyncClient(base_url=replay_edge.url, timeout=WAIT_S) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    message = answer["choices"][0]["message"]
    assert message["content"] == content
    assert message.get("reasoning_content") == reasoning
    got = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]
    assert got == calls
    assert answer["choices"][0]["finish_reason"] == ("tool_calls" if calls else "stop")
    u = answer["usage"]
    assert (
        u["prompt_tokens"],
        u["completion_tokens"],
        u["prompt_tokens_details"]["cached_tokens"],
        u["completion_tokens_details"]["reasoning_tokens"],
    ) == usage
    (sent,) = upstream.requests
    assert sent["model"] == model
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["tools"] == [WEATHER_TOOL]
    assert (sent["temperature"], sent["max_tokens"], sent["seed"], sent["top_k"]) == (
        0.5,
        99,
        3,
        20,
    )


async def test_server_that_does_not_stream(replay_edge: RunningEdge) -> None:
    """A server that answers `stream: true` with one JSON chat.completion still works."""
    async with httpx.AsyncClient(base_url=replay_edge.url, timeout=WAIT_S) as client:
        response = await client.post("/v1/chat/completions", json=_chat("no-stream"))
    choice = response.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Whole answer.", "length")
    assert response.json()["usage"]["total_tokens"] == 13


@pytest.mark.parametrize(
    ("model", "expected", "status"),
    [
        ("vllm-too-long", "This model's maximum context length", 400),
        ("llamacpp-loading", "upstream returned 503: Loading model", 502),
        ("ollama-missing", 'model "llama3.2" not found', 404),
        ("stream-error", "upstream error: The engine died unexpectedly. (code 500)", None),
        ("truncated", "upstream stream ended early", None),
        ("abort", "upstream stream ended early", None),
        ("web-ui", "upstream answered text/html, not an event stream: '<!doctype html>", 502),
    ],
)
async def test_upstream_failures_are_error_frames(
    replay_edge: RunningEdge, model: str, expected: str, status: int | None
) -> None:
    """Error statuses, in-stream errors and broken streams end in one error frame that
    quotes the upstream; nothing hangs. A failure before any output (`status`) is not
    200 and a frame but a real status with the same error: 502, or the upstream's own
    for a request it refused (400, 404), with its words as they are."""
    async with httpx.AsyncClient(base_url=replay_edge.url, timeout=WAIT_S) as client:
        response = await client.post("/v1/chat/completions", json=_chat(model, stream=True))
    if status is not None:
        assert response.status_code == status, response.text
        message = response.json()["error"]["message"]
        assert expected in message
        if status != 502:
            assert message.startswith(expected)
        return
    payloads = _sse_payloads(response.content)
    assert b"data: [DONE]" not in response.content
    assert expected in payloads[-1]["error"]["message"]


@pytest.mark.parametrize("model", ["big", "big-whole"])
async def test_a_large_event_reaches_the_caller_whole(replay_edge: RunningEdge, model: str) -> None:
    """An event, or a whole answer, past what the relay parses on the edge's loop
    (OFFLOAD_CHARS: parsed in a worker thread) reaches the caller whole, streamed or not."""
    assert BIG > OFFLOAD_CHARS
    async with httpx.AsyncClient(base_url=replay_edge.url, timeout=WAIT_S) as client:
        streamed = await client.post("/v1/chat/completions", json=_chat(model, stream=True))
        whole = await client.post("/v1/chat/completions", json=_chat(model))
    payloads = _sse_payloads(streamed.content)
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p["choices"])
    assert text == _big_content()
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    assert whole.json()["choices"][0]["message"]["content"] == _big_content()


async def test_client_disconnect_aborts_the_upstream_request(
    replay_edge: RunningEdge, upstream: Upstream
) -> None:
    """A caller that goes away mid-stream closes the upstream HTTP request at once: the
    run's one cancel on the node (its runs go to the upstream from the edge, so no
    CancelRun follows), counted once; the run ends `cancelled`."""
    body = _chat("hang", stream=True)
    async with (
        httpx.AsyncClient(base_url=replay_edge.url, timeout=WAIT_S) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if '"content":"x"' in line:
                run_id = json.loads(line.removeprefix("data: "))["id"].removeprefix("chatcmpl-")
                break
    with trio.fail_after(WAIT_S):
        await upstream.hung_up.wait()
    await replay_edge.wait_idle()
    assert replay_edge.outcome(run_id).status == "cancelled"
    assert replay_edge.counted("iop_edge_node_cancels_total", node="replay") == 1


async def test_a_silent_upstream_is_a_timeout_and_its_request_is_closed(
    nursery: trio.Nursery, upstream: Upstream
) -> None:
    """An upstream that answers nothing, not even headers: past `first_event_s` the caller
    gets the edge's timeout, and the upstream request the edge relayed is closed."""
    config = replace(
        _edge_config(NodeConfig("replay", f"openai+{upstream.url}")),
        timeouts=TimeoutsConfig(first_event_s=0.2),
    )
    running = await start_edge(nursery, config)
    async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as client:
        response = await client.post("/v1/chat/completions", json=_chat("silent"))
    assert response.status_code == 504, response.text
    assert "first" in response.json()["error"]["message"]
    with trio.fail_after(WAIT_S):
        await upstream.hung_up.wait()
    await running.wait_idle()
    assert running.counted("iop_edge_node_cancels_total", node="replay") == 1
    await stop_edge(running)


async def test_the_node_reports_count_the_runs_the_edge_relays(
    nursery: trio.Nursery, upstream: Upstream
) -> None:
    """An `openai+http://` node's runs skip its iop-node, yet its reports (the pool's load
    for it) count them as its runs in flight while they run, and not once they ended."""
    config = replace(
        _edge_config(NodeConfig("replay", f"openai+{upstream.url}")),
        routing=RoutingConfig(watch_heartbeat_s=0.05),
    )
    running = await start_edge(nursery, config)
    node = running.node("replay")

    def reported(active: int) -> Callable[[], bool]:
        return lambda: node.load is not None and node.load.active == active

    await poll(reported(0))
    async with (
        httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as http,
        http.stream("POST", "/v1/chat/completions", json=_chat("hang", stream=True)) as response,
    ):
        async for line in response.aiter_lines():
            if '"content":"x"' in line:
                await poll(reported(1))
                break
    await running.wait_idle()
    await poll(reported(0))
    await stop_edge(running)


async def test_a_large_request_reaches_the_upstream_whole(
    replay_edge: RunningEdge, upstream: Upstream
) -> None:
    """A request past what the edge prepares on its loop for an `openai+http://` node
    (INLINE_BYTES: read in a worker thread) reaches the upstream whole, and its answer
    the caller, as a small one does."""
    content = "word " * (2 * INLINE_BYTES // 5)
    async with httpx.AsyncClient(base_url=replay_edge.url, timeout=WAIT_S) as client:
        for text in ("small", content):
            response = await client.post("/v1/chat/completions", json=_chat("vllm", text))
            assert response.status_code == 200, response.text
            assert upstream.requests[-1]["messages"] == [{"role": "user", "content": text}]


# --- the node over gRPC, without an edge ------------------------------------------


async def _events(
    where: NodeSocket, request: pb.RunRequest, nursery: trio.Nursery
) -> list[NodeEvent]:
    client = GrpcNodeClient("node", where)
    try:
        with trio.fail_after(WAIT_S):
            handle = await client.start_run(nursery, request, deadline=trio.current_time() + WAIT_S)
            return await node_events(handle)
    finally:
        await client.aclose()


async def test_iop_node_sends_its_api_key_with_each_run(
    nursery: trio.Nursery, upstream: Upstream, tmp_path: Path
) -> None:
    """`--api-key-env`: iop-node sends `Authorization: Bearer KEY` with each run's request
    to its upstream, with the body's JSON content type."""
    key = {"IOP_TEST_UPSTREAM_KEY": "sk-test"}
    start = partial(start_upstream_node, tmp_path / "runs.jsonl", upstream.url, env=key)
    node = await trio.to_thread.run_sync(start, "--api-key-env", "IOP_TEST_UPSTREAM_KEY")
    try:
        request = pb.RunRequest(
            run_id="k1", model="vllm", messages=[pb.Message(role="user", content="x")]
        )
        async with asyncio_loop():
            events = await _events(
                NodeSocket.tcp("127.0.0.1", int(node.address.rsplit(":", 1)[1])), request, nursery
            )
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)
    assert isinstance(events[-1], Complete)
    (headers,) = upstream.headers
    assert headers["authorization"] == "Bearer sk-test"
    assert headers["content-type"] == "application/json"


async def test_deadline_closes_the_upstream_request(
    nursery: trio.Nursery, upstream: Upstream
) -> None:
    """The RunRequest's deadline ends the run `cancelled` and aborts the upstream request."""
    request = pb.RunRequest(
        run_id="d1",
        model="hang",
        messages=[pb.Message(role="user", content="x")],
        deadline_unix_ms=int((time.time() + 0.3) * 1000),
    )
    async with asyncio_loop(), embedded_upstream_node("n", upstream.url) as (node, where):
        events = await _events(where, request, nursery)
        with trio.fail_after(WAIT_S):
            await upstream.hung_up.wait()
    assert events[0] == Delta("x")
    assert events[-1] == Failed(kind="cancelled", error="run deadline exceeded")
    assert node.finished[-1]["outcome"] == "cancelled"


async def test_chunks_read_together_go_to_the_edge_as_one_delta(
    nursery: trio.Nursery, upstream: Upstream
) -> None:
    """Chunks the upstream wrote at once reach the node in one read and go on as fewer
    deltas than chunks (one, unless the read was split), with all their text in order."""
    request = pb.RunRequest(
        run_id="b1", model="burst", messages=[pb.Message(role="user", content="x")]
    )
    async with asyncio_loop(), embedded_upstream_node("n", upstream.url) as (_, where):
        events = await _events(where, request, nursery)
    deltas = [e for e in events if isinstance(e, Delta)]
    assert "".join(d.text for d in deltas) == "".join(f"w{i} " for i in range(BURST))
    assert len(deltas) < BURST
    assert isinstance(events[-1], Complete)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_connection_refused_is_an_error_event_and_describe_fails(
    nursery: trio.Nursery,
) -> None:
    """With nothing listening upstream, a run ends in an error naming the URL, and
    Describe fails so the edge marks the node unhealthy."""
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    request = pb.RunRequest(run_id="r", model="m", messages=[pb.Message(role="user", content="x")])
    async with asyncio_loop(), embedded_upstream_node("n", url) as (_, where):
        events = await _events(where, request, nursery)
        client = GrpcNodeClient("node", where)
        with pytest.raises(EdgeError, match=r"UNAVAILABLE.*unreachable"):
            await client.describe()
        await client.aclose()
    (event,) = events
    assert isinstance(event, Failed)
    assert event.kind == "error"
    assert event.error.startswith(f"cannot connect to upstream {url}/chat/completions")


async def test_describe_lists_the_upstream_models(
    nursery: trio.Nursery, upstream: Upstream
) -> None:
    """Describe answers the upstream's /models."""
    async with asyncio_loop(), embedded_upstream_node("n", upstream.url) as (_, where):
        client = GrpcNodeClient("node", where)
        description = await client.describe()
        await client.aclose()
    assert list(description.models) == upstream.models()


async def test_iop_node_tells_a_reading_caller_its_run_was_cancelled(
    upstream: Upstream, tmp_path: Path
) -> None:
    """CancelRun while the caller reads (iop-node as a process): the run's terminal is the
    node's `cancelled` event, the upstream request is closed, one CancelRun is logged."""
    node = await trio.to_thread.run_sync(
        start_upstream_node, tmp_path / "iop-node-runs.jsonl", upstream.url
    )
    try:
        request = pb.RunRequest(
            run_id="c1", model="hang", messages=[pb.Message(role="user", content="x")]
        )
        events = await cancel_while_reading(node.address, request)
        with trio.fail_after(WAIT_S):
            await upstream.hung_up.wait()
        record = await node.wait_run("c1")
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)
    assert [(e.type, e.delta, e.error) for e in events] == [
        ("delta", "x", ""),
        ("cancelled", "", "run cancelled"),
    ]
    assert (record["outcome"], record["cancel_rpcs"]) == ("cancelled", 1)


# --- the chain: SDK -> edge B -> iop-node -> edge A -> iop-sim-node --------------------


@dataclass
class Chain:
    a: RunningEdge
    node: SimProcess
    b: RunningEdge

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.b.url + "/v1", api_key="unused", max_retries=0, timeout=30
        )


@pytest.fixture
async def chain(nursery: trio.Nursery, edge: RunningEdge, tmp_path: Path) -> AsyncIterator[Chain]:
    node = await trio.to_thread.run_sync(
        start_upstream_node, tmp_path / "iop-node-runs.jsonl", edge.url + "/v1"
    )
    try:
        b = await start_edge(nursery, _edge_config(NodeConfig("iop-node", node.address)))
        yield Chain(edge, node, b)
        await stop_edge(b)
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)


async def _in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


async def test_chain_streaming(chain: Chain, sim: SimProcess) -> None:
    """Streamed text crosses both edges and the node intact; each hop records a complete run."""

    def call() -> list[Any]:
        with chain.sdk() as client:
            return list(
                client.chat.completions.create(
                    model="sim-echo",
                    messages=[{"role": "user", "content": "hello big world"}],
                    stream=True,
                )
            )

    chunks = await _in_thread(call)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hello big world"
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    run = await chain.node.wait_run(chunks[0].id.removeprefix("chatcmpl-"))
    assert (run["outcome"], run["cancel_rpc"]) == ("complete", False)
    await chain.a.wait_idle()
    ((info, _),) = chain.a.outcomes
    assert (await sim.wait_run(info.run_id))["outcome"] == "complete"


async def test_chain_non_streaming_reasoning_and_usage(chain: Chain) -> None:
    """Reasoning and every usage count (reasoning, cached) survive two edges and the node."""
    events = script(
        {"type": "reasoning_delta", "delta": "Let me think."},
        {"type": "delta", "delta": "42"},
        {
            "type": "complete",
            "usage": {
                "input_tokens": 7,
                "output_tokens": 3,
                "reasoning_tokens": 2,
                "cached_input_tokens": 4,
            },
        },
    )

    def call() -> Any:
        with chain.sdk() as client:
            return client.chat.completions.create(
                model="sim-script", messages=[{"role": "user", "content": events}]
            )

    completion = await _in_thread(call)
    message = completion.choices[0].message
    assert message.content == "42"
    assert message.model_extra["reasoning_content"] == "Let me think."
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 3)
    assert usage.completion_tokens_details.reasoning_tokens == 2
    assert usage.prompt_tokens_details.cached_tokens == 4


async def test_chain_streaming_tool_call(chain: Chain) -> None:
    """A native tool call from the bottom node arrives whole, with its id and arguments."""
    call_json = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
    }
    events = script(
        {"type": "complete", "metadata": {"finish_reason": "tool_calls", "tool_calls": [call_json]}}
    )

    def call() -> list[Any]:
        with chain.sdk() as client:
            return list(
                client.chat.completions.create(
                    model="sim-script",
                    messages=[{"role": "user", "content": events}],
                    tools=[WEATHER_TOOL],  # type: ignore[list-item]
                    stream=True,
                )
            )

    chunks = await _in_thread(call)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.id, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        ("call_7", "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_chain_error(chain: Chain) -> None:
    """An error at the bottom reaches the SDK through the node as an APIError quoting it."""

    def call() -> None:
        with chain.sdk() as client:
            for _ in client.chat.completions.create(
                model="sim-script",
                messages=[
                    {"role": "user", "content": script({"type": "error", "error": "GPU on fire"})}
                ],
                stream=True,
            ):
                pass

    with pytest.raises(openai.APIError, match="GPU on fire"):
        await _in_thread(call)


async def test_chain_cancellation(chain: Chain, sim: SimProcess) -> None:
    """A client that closes the stream early cancels the run on every hop: the node's
    run and the simulated node's run both end `cancelled`."""
    hang = script({"type": "delta", "delta": "x"}, {"type": "hang"})

    def call() -> str:
        with chain.sdk() as client:
            stream = client.chat.completions.create(
                model="sim-script", messages=[{"role": "user", "content": hang}], stream=True
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content == "x":
                    stream.close()
                    return str(chunk.id)
        raise AssertionError("the stream ended before its first delta")

    response_id = await _in_thread(call)
    node_run = await chain.node.wait_run(response_id.removeprefix("chatcmpl-"))
    assert node_run["outcome"] == "cancelled"
    await chain.a.wait_idle()
    ((info, outcome),) = chain.a.outcomes
    assert outcome.status == "cancelled"
    sim_run = await sim.wait_run(info.run_id)
    assert sim_run["outcome"] == "cancelled"
    assert sim_run["cancel_rpc"]


async def test_in_process_address_against_an_edge(nursery: trio.Nursery, edge: RunningEdge) -> None:
    """`address = "openai+http://.../v1"` runs the adapter inside the edge: no second daemon."""
    running = await start_edge(nursery, _edge_config(NodeConfig("local", f"openai+{edge.url}/v1")))
    async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as client:
        models = (await client.get("/v1/models")).json()
        response = await client.post(
            "/v1/chat/completions", json=_chat("sim-echo", "one two", stream=True)
        )
    assert {m["id"] for m in models["data"]} >= {"sim-echo", "sim-script"}
    payloads = _sse_payloads(response.content)
    assert (
        "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p["choices"])
        == "one two"
    )
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    await stop_edge(running)


async def test_a_client_that_stops_reading_ends_the_relayed_run_once(
    nursery: trio.Nursery, edge: RunningEdge, sim: SimProcess
) -> None:
    """A client that keeps its socket open but stops reading, in front of an edge that
    relays its runs (the model server here another edge): once output has waited
    `slow_client_s`, the relayed request is closed, counted once, and the model server's
    run ends `cancelled` too."""
    address = f"openai+{edge.url}/v1"
    config = replace(
        _edge_config(NodeConfig("local", address)), timeouts=TimeoutsConfig(slow_client_s=0.5)
    )
    running = await start_edge(nursery, config)
    flood = script({"type": "delta", "delta": "x" * 4096, "repeat": 20_000})
    body = _chat("sim-script", flood, stream=True)
    async with stalled_stream(running.url, body, rcvbuf=16 * 1024) as (head, _, _):
        assert head.startswith(b"HTTP/1.1 200")
        await running.wait_idle(within_s=30)
        ((_, outcome),) = running.outcomes
        assert outcome.status == "cancelled"
        assert running.counted("iop_edge_node_cancels_total", node="local") == 1
        await edge.wait_idle(within_s=30)
        ((info, inner),) = edge.outcomes
        assert inner.status == "cancelled"
        run = await sim.wait_run(info.run_id, within_s=30)
        assert run["outcome"] == "cancelled"
        assert run["events_sent"] < 20_000
    await stop_edge(running)


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_logprobs_reach_the_caller(
    replay_edge: RunningEdge, upstream: Upstream, stream: bool
) -> None:
    """vLLM's recorded `logprobs.content` reaches the SDK in OpenAI's shape, streaming or
    not (the reasoning chunk's logprobs are not content's); the upstream was asked for them."""

    def call() -> list[Any]:
        with openai.OpenAI(
            base_url=replay_edge.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S
        ) as client:
            answer = client.chat.completions.create(
                model="vllm-logprobs",
                messages=[{"role": "user", "content": "hi"}],
                logprobs=True,
                top_logprobs=2,
                stream=stream,
            )
            if not stream:
                return list(answer.choices[0].logprobs.content)
            return [
                t
                for c in answer
                if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content
            ]

    tokens = await trio.to_thread.run_sync(call)
    assert [(t.token, t.logprob) for t in tokens] == [
        ("Hello", -0.0123),
        (" there", -0.25),
        ("!", -9999.0),
    ]
    assert [a.token for a in tokens[0].top_logprobs] == ["Hello", "Hi"]
    assert tokens[0].bytes == list(b"Hello")
    (sent,) = upstream.requests
    assert (sent["logprobs"], sent["top_logprobs"]) == (True, 2)
