"""A refused request is not a failed node: over real processes.

A node's refusal (an `error` event with a 4xx status but 408 and 429: the
request is at fault) answers the client with that status and the model
server's words, in each API's shape, and is neither tried on another node
nor counted on any breaker; a node's 429 (overloaded) is tried on another
node, and when none is left the client gets a 429 with Retry-After.

- `iop-node` processes in front of a small OpenAI-compatible server
  (`MockUpstream`, real sockets on 127.0.0.1) that refuses a model the way
  vLLM does (400, its error object), or answers 429, or streams an answer;
  two nodes in the edge's config, so a failover would show (in the mock's
  request count and the nodes' runs logs).
- The simulated node's scripted refusal (`"http_status"` on an error step)
  on chat completions, responses and messages, streamed and not, before
  and after output.

Waits are bounded polls on another process's runs log; nothing asserts a
duration.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio

from edge.config import Config, NodeConfig, RoutingConfig, ServerConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    named_sims,
    poll,
    script,
    sse_frames,
    start_edge,
    start_upstream_node,
    stop_edge,
    stop_process,
)
from tests.integration.rawhttp import read_request, send_events, serve_upstream

WAIT_S = 20.0
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
# vLLM's answer to a prompt past the model's context (its error object, status 400).
TOO_LONG_WORDS = (
    "This model's maximum context length is 32768 tokens. However, you requested 40000"
    " tokens (8000 in the messages, 32000 in the completion). Please reduce the length of"
    " the messages or completion."
)
TOO_LONG = json.dumps(
    {"object": "error", "message": TOO_LONG_WORDS, "type": "BadRequestError", "param": None,
     "code": 400}
).encode()  # fmt: skip
BUSY_WORDS = "The server is busy; retry later."
BUSY = json.dumps({"error": {"message": BUSY_WORDS, "type": "rate_limit_error"}}).encode()


# --- the mock upstream -------------------------------------------------------------------


@dataclass
class MockUpstream:
    """An OpenAI-compatible server: a model named in `errors` gets that (status, body),
    any other a short streamed answer ("fine"); a path other than its model list and
    chat completions is a 404. Counts the chat completions asked of it, by model."""

    errors: dict[str, tuple[int, bytes]]
    url: str = ""
    requests: Counter[str] = field(default_factory=Counter)


def _whole(status: int, body: bytes) -> list[Any]:
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    return [h11.Response(status_code=status, headers=headers), h11.Data(body), h11.EndOfMessage()]


def _answer() -> list[Any]:
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": "fine"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    body = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
    head = h11.Response(status_code=200, headers=[("content-type", "text/event-stream")])
    return [head, h11.Data(body), h11.EndOfMessage()]


async def _serve(upstream: MockUpstream, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    async with stream:
        try:
            while (received := await read_request(stream, conn)) is not None:
                request, body = received
                if request.target == b"/v1/models":
                    models = [{"id": m, "object": "model"} for m in upstream.errors]
                    events = _whole(200, json.dumps({"object": "list", "data": models}).encode())
                elif request.target != b"/v1/chat/completions":  # its /metrics, say: none
                    events = _whole(404, b'{"detail":"Not Found"}')
                else:
                    model = json.loads(body)["model"]
                    upstream.requests[model] += 1
                    error = upstream.errors.get(model)
                    events = _answer() if error is None else _whole(*error)
                await send_events(stream, conn, *events)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, h11.ProtocolError):
            return


@dataclass
class Fleet:
    edge: RunningEdge
    upstreams: tuple[MockUpstream, ...]
    nodes: tuple[SimProcess, ...]


@asynccontextmanager
async def _fleet(
    nursery: trio.Nursery, tmp_path: Path, *errors: dict[str, tuple[int, bytes]]
) -> AsyncIterator[Fleet]:
    """Nodes "a", "b", ...: one `iop-node` process each, in front of a mock upstream of its
    own answering as `errors` says; an edge routing to them, in this order (a request
    goes to "a" first: each node is as loaded as the other)."""
    upstreams: list[MockUpstream] = []
    nodes: list[SimProcess] = []
    async with AsyncExitStack() as stack:
        for name, table in zip("abc", errors, strict=False):
            upstream = MockUpstream(table)
            upstream.url = await serve_upstream(nursery, partial(_serve, upstream))
            node = await trio.to_thread.run_sync(
                partial(
                    start_upstream_node, tmp_path / f"{name}-runs.jsonl", upstream.url,
                    "--models", "long", "busy", "m", "fine",
                )
            )  # fmt: skip
            stack.callback(stop_process, node.process)
            upstreams.append(upstream)
            nodes.append(node)
        config = Config(
            server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
            routing=RoutingConfig(retries=2, retry_backoff_s=0.01),
            nodes=tuple(NodeConfig(name, n.address) for name, n in zip("abc", nodes, strict=False)),
        )
        running = await start_edge(nursery, config)
        try:
            yield Fleet(running, tuple(upstreams), tuple(nodes))
        finally:
            await stop_edge(running)


def _counter(edge: RunningEdge, name: str, **labels: str) -> float:
    return edge.edge.metrics.registry.get_sample_value(name, labels) or 0.0


async def _all_healthy(http: httpx.AsyncClient, nodes: int) -> None:
    """/readyz is 200 and every node is up, its breaker closed, no failure counted."""
    ready = await http.get("/readyz")
    assert ready.status_code == 200, ready.text
    states = [(n["state"], n["failed_runs_in_a_row"]) for n in ready.json()["nodes"]]
    assert states == [("up", 0)] * nodes


def _body(path: str, model: str, content: str, stream: bool) -> dict[str, Any]:
    """A request of the API at `path` whose one user message is `content`."""
    if path == RESPONSES:
        return {"model": model, "input": content, "stream": stream}
    body = {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream}
    if path == MESSAGES:
        body["max_tokens"] = 64
    return body


# --- iop-node in front of a server that refuses -------------------------------------------


async def test_twenty_refusals_in_a_row_leave_every_node_healthy(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """20 requests in a row that the model server refuses (vLLM's 400, prompt too long),
    streamed and not, through iop-node: each is a 400 with the server's words and the
    code context_length_exceeded, run once on one node (the server asked 20 times, the
    nodes' runs logs hold 20 runs, each id once: no failover), counted as refusals and
    not as node errors or retries; every breaker stays closed, /readyz 200, and a valid
    request right after is answered 200."""
    table = {"long": (400, TOO_LONG)}
    async with (
        _fleet(nursery, tmp_path, table, table) as fleet,
        httpx.AsyncClient(base_url=fleet.edge.url, timeout=WAIT_S) as http,
    ):
        for i in range(20):
            response = await http.post(CHAT, json=_body(CHAT, "long", "hi", stream=i % 2 == 1))
            assert response.status_code == 400, response.text
            assert response.json() == {
                "error": {"message": TOO_LONG_WORDS, "type": "invalid_request_error",
                          "param": None, "code": "context_length_exceeded"},
            }  # fmt: skip
        edge = fleet.edge
        await edge.wait_idle()
        assert sum(u.requests["long"] for u in fleet.upstreams) == 20
        run_ids = [info.run_id for info, _ in edge.outcomes]
        assert len(set(run_ids)) == 20

        def logged() -> list[str]:
            return [r["run_id"] for node in fleet.nodes for r in node.runs() if "outcome" in r]

        await poll(lambda: len(logged()) >= 20)
        assert sorted(logged()) == sorted(run_ids)
        assert all(
            r["outcome"] == "error" for node in fleet.nodes for r in node.runs() if "outcome" in r
        )
        assert edge.counted("iop_edge_run_refusals_total") == 20
        assert edge.counted("iop_edge_retries_total") == 0
        assert edge.counted("iop_edge_node_errors_total") == 0
        await _all_healthy(http, 2)
        fine = await http.post(CHAT, json=_body(CHAT, "fine", "hi", stream=False))
        assert fine.status_code == 200, fine.text
        assert fine.json()["choices"][0]["message"]["content"] == "fine"


async def test_an_overloaded_node_is_failed_over_and_all_overloaded_is_a_429(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A node whose server answers 429 has the request tried on the other node, which
    answers it (streamed and not); when every node's server answers 429 the client gets
    a 429 with Retry-After and the server's words, in each API's rate-limit shape. No
    breaker counts any of it."""
    busy = (429, BUSY)
    async with (
        _fleet(nursery, tmp_path, {"m": busy, "busy": busy}, {"busy": busy}) as fleet,
        httpx.AsyncClient(base_url=fleet.edge.url, timeout=WAIT_S) as http,
    ):
        edge = fleet.edge
        for stream in (False, True):
            response = await http.post(CHAT, json=_body(CHAT, "m", "hi", stream=stream))
            assert response.status_code == 200, response.text
            assert "fine" in response.text
        a, b = fleet.upstreams
        assert (a.requests["m"], b.requests["m"]) == (2, 2)
        assert _counter(edge, "iop_edge_retries_total", node="a", reason="overloaded") == 2
        for stream in (False, True):
            response = await http.post(CHAT, json=_body(CHAT, "busy", "hi", stream=stream))
            assert response.status_code == 429, response.text
            assert response.headers["retry-after"] == "1"
            assert response.json() == {
                "error": {"message": BUSY_WORDS, "type": "rate_limit_exceeded", "param": None,
                          "code": None},
            }  # fmt: skip
        response = await http.post(MESSAGES, json=_body(MESSAGES, "busy", "hi", stream=False))
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert BUSY_WORDS in response.json()["error"]["message"]
        assert (a.requests["busy"], b.requests["busy"]) == (3, 3)
        await edge.wait_idle()
        assert _counter(edge, "iop_edge_run_refusals_total", node="a", status="429") == 5
        assert _counter(edge, "iop_edge_run_refusals_total", node="b", status="429") == 3
        assert edge.counted("iop_edge_node_errors_total") == 0
        await _all_healthy(http, 2)


# --- the simulated node's scripted refusal, on each API -----------------------------------

REFUSAL = {"type": "error", "error": "context_length_exceeded", "message": "prompt too long"}
# The status a node refuses with -> Anthropic's error type for it.
ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}


def _refusal_body(path: str, status: int) -> dict[str, Any]:
    """What `path` answers a refusal with `status` before any byte."""
    if path == MESSAGES:
        error = {"type": ANTHROPIC_TYPES[status], "message": "prompt too long"}
        return {"type": "error", "error": error}
    return {"error": {"message": "prompt too long", "type": "invalid_request_error",
                      "param": None, "code": "context_length_exceeded"}}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
@pytest.mark.parametrize("status", [400, 404, 413])
async def test_a_scripted_refusal_is_the_nodes_status_on_every_api(
    edge: RunningEdge, sim: SimProcess, path: str, stream: bool, status: int
) -> None:
    """A refusal before any output is a real HTTP status, the node's, with its words and
    code in the API's own error shape (Anthropic's not_found_error for 404 and
    request_too_large for 413), streamed or not; no breaker counts it."""
    body = _body(path, "sim-script", script({**REFUSAL, "http_status": status}), stream)
    async with httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http:
        response = await http.post(path, json=body)
        assert response.status_code == status, response.text
        assert response.headers["content-type"] == "application/json"
        assert response.json() == _refusal_body(path, status)
        await _all_healthy(http, 1)
    await edge.wait_idle()
    assert _counter(edge, "iop_edge_run_refusals_total", node="sim", status=str(status)) == 1
    assert edge.counted("iop_edge_node_errors_total") == 0


@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
async def test_a_refusal_after_output_is_an_error_frame(edge: RunningEdge, path: str) -> None:
    """After output, a refusal ends the stream as a node error does, with its terminal in
    the API's shape and the node's words: chat's error object (its code, no [DONE]),
    responses' response.failed (its code), messages' error event. Not streamed, the
    answer is whole only at its end: the node's status."""
    content = script({"type": "delta", "delta": "partial"}, {**REFUSAL, "http_status": 400})
    async with httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http:
        response = await http.post(path, json=_body(path, "sim-script", content, stream=True))
        assert response.status_code == 200, response.text
        assert "partial" in response.text
        assert "data: [DONE]" not in response.text
        last = sse_frames(response.text)[-1]
        if path == CHAT:
            assert last == _refusal_body(CHAT, 400)
        elif path == RESPONSES:
            assert last["type"] == "response.failed"
            assert last["response"]["error"] == {
                "code": "context_length_exceeded", "message": "prompt too long",
            }  # fmt: skip
        else:
            assert last == {"type": "error", "error": _refusal_body(MESSAGES, 400)["error"]}
            assert response.text.rstrip("\n").splitlines()[-2] == "event: error"
        whole = await http.post(path, json=_body(path, "sim-script", content, stream=False))
        assert whole.status_code == 400, whole.text
        assert whole.json() == _refusal_body(path, 400)
        await _all_healthy(http, 1)


# --- a script the simulated node cannot play ----------------------------------------------

# What the node cannot play: no script at all, a script that does not parse, a number past
# its bound, a turn past the script's last.
BAD_SCRIPTS = (
    ("Please answer this.", "no message holds a script"),
    ('Run {"events": [{"type": "delta", "delta": "x"},, {"type": "complete"}]} now', "not JSON"),
    (script({"sleep_ms": -1}, {"type": "complete"}), "events[0].sleep_ms must be a number"),
)


async def test_a_script_the_node_cannot_play_is_refused_and_counts_on_no_breaker(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Scripts the simulated node cannot find, parse or play, more of them than the breaker
    takes (CrewAI's retries, a few curls): each is the node's refusal, a 400 with its
    words and code `invalid_script` on chat and Messages, streamed or not, run once on one
    node (no failover); no breaker opens, and `sim-echo` answers right after."""
    with named_sims(tmp_path, "a", "b") as nodes:
        config = Config(
            server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
            routing=RoutingConfig(retries=2, retry_backoff_s=0.01, breaker_failures=2),
            nodes=tuple(NodeConfig(n, node.address) for n, node in zip("ab", nodes, strict=True)),
        )
        edge = await start_edge(nursery, config)
        async with httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http:
            sent = 0
            for path in (CHAT, MESSAGES):
                for stream in (False, True):
                    for content, words in BAD_SCRIPTS:
                        body = _body(path, "sim-script", content, stream)
                        response = await http.post(path, json=body)
                        sent += 1
                        assert response.status_code == 400, response.text
                        error = response.json()["error"]
                        assert error["type"] == "invalid_request_error"
                        assert words in error["message"]
                        if path == CHAT:
                            assert error["code"] == "invalid_script"
            await edge.wait_idle()
            assert edge.counted("iop_edge_run_refusals_total") == sent
            assert edge.counted("iop_edge_retries_total") == 0
            assert edge.counted("iop_edge_node_errors_total") == 0
            await _all_healthy(http, 2)

            def logged() -> int:
                return sum(1 for node in nodes for r in node.runs() if "outcome" in r)

            await poll(lambda: logged() >= sent)
            assert logged() == sent  # each run once: nothing tried on the other node
            echo = await http.post(CHAT, json=_body(CHAT, "sim-echo", "still here", False))
            assert echo.status_code == 200, echo.text
            assert echo.json()["choices"][0]["message"]["content"] == "still here"
        await stop_edge(edge)
