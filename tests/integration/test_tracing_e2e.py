"""OpenTelemetry traces end to end: one trace through the edge, its node and the model server.

The chain is real processes on 127.0.0.1, each exporting OTLP/HTTP to a
receiver the test runs (`tests.integration.otlp`):

    client (traceparent) -> iop-edge "edge" -> iop-node "node" -> iop-edge "upstream"
                                                                   (its embedded sim node)

The upstream is itself an OpenAI-compatible server (an edge) with tracing
on, so its span shows that the `traceparent` header of iop-node's request
reached it. The rest runs an edge in this process (its tracer is its own,
not the global one) for what one trace cannot show at once.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from edge.config import Config, NodeConfig, ServerConfig
from edge.http.spans import MAX_CAPTURED_CHARS
from edge.observe.tracing import TracingConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    script,
    start_edge,
    start_upstream_node,
    stop_edge,
    stop_process,
)
from tests.integration.edgeproc import edge_process, free_port
from tests.integration.otlp import OtlpReceiver, ReceivedSpan, otlp_receiver

WAIT_S = 10.0
CHAT = "/v1/chat/completions"


def _env(receiver: OtlpReceiver, service: str) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "20",  # ms: spans leave at once, the test waits less
    }


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _one(spans: list[ReceivedSpan], service: str, kind: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.kind == kind]
    assert len(found) == 1, (service, kind, [(s.service, s.kind, s.name) for s in spans])
    return found[0]


_EDGE_CONFIG = """
[server]
listen = "127.0.0.1:{port}"
keepalive_s = 0
node_refresh_s = {refresh}

[[nodes]]
name = "{node_name}"
address = "{address}"
"""


async def test_one_trace_through_edge_node_and_upstream(tmp_path: Path) -> None:
    """A streamed request with a client's traceparent gives one trace: the edge's SERVER span
    (child of the client's), the node's run span (child of the edge's, through gRPC
    metadata), its CLIENT span to the model server, and the model server's own span (child
    of that one: the upstream got the traceparent header), with the GenAI attributes and
    the request's events; no prompt or completion text (capture_content is off)."""
    traceparent, trace_id, client_span_id = _traceparent()
    node: SimProcess | None = None
    with otlp_receiver() as receiver:
        upstream_port = free_port()
        upstream_toml = _EDGE_CONFIG.format(
            port=upstream_port, refresh=5, node_name="sim", address="embedded"
        )
        try:
            async with trio.open_nursery() as nursery:
                # The node starts meanwhile (it asks the upstream for models only when asked).
                node_started = trio.Event()

                def spawn_node() -> SimProcess:
                    return start_upstream_node(
                        tmp_path / "node-runs.jsonl", f"http://127.0.0.1:{upstream_port}/v1",
                        env=_env(receiver, "node"),
                    )  # fmt: skip

                async def start_node() -> None:
                    nonlocal node
                    node = await trio.to_thread.run_sync(spawn_node)
                    node_started.set()

                nursery.start_soon(start_node)
                async with edge_process(
                    tmp_path, upstream_toml, env=_env(receiver, "upstream"), name="upstream"
                ):
                    await node_started.wait()
                    assert node is not None
                    edge_toml = _EDGE_CONFIG.format(
                        port=0, refresh=0.1, node_name="node", address=node.address
                    )
                    async with edge_process(
                        tmp_path, edge_toml, env=_env(receiver, "edge"), name="edge"
                    ) as edge:
                        await _stream_once(edge.url, traceparent)
                        spans = await receiver.wait_spans(trace_id, 5)
        finally:
            if node is not None:
                stop_process(node.process)

    edge_span = _one(spans, "edge", "server")
    node_span = _one(spans, "node", "server")
    upstream_call = _one(spans, "node", "client")
    upstream_spans = [s for s in spans if s.service == "upstream" and s.kind == "server"]
    (upstream_edge,) = [s for s in upstream_spans if "http.request.method" in s.attributes]
    (upstream_sim,) = [s for s in upstream_spans if s is not upstream_edge]

    # One trace, each hop the child of the one before it.
    assert {s.trace_id for s in spans} == {trace_id}
    assert edge_span.parent_span_id == client_span_id
    assert node_span.parent_span_id == edge_span.span_id
    assert upstream_call.parent_span_id == node_span.span_id
    assert upstream_edge.parent_span_id == upstream_call.span_id  # the header reached it
    assert upstream_sim.parent_span_id == upstream_edge.span_id

    a = edge_span.attributes
    assert edge_span.name == "chat sim-echo"
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "iop"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "sim-echo"
    assert a["gen_ai.response.id"] == f"chatcmpl-{a['iop.run_id']}"
    assert a["gen_ai.response.finish_reasons"] == ["stop"]
    assert a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.usage.input_tokens"] > 0
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.max_tokens"]) == (0.5, 50)
    assert "gen_ai.request.top_p" not in a  # only the parameters that were set
    assert (a["http.request.method"], a["http.response.status_code"]) == ("POST", 200)
    assert a["url.path"] == CHAT
    assert a["iop.node"] == "node"
    assert "error.type" not in a
    assert edge_span.event("node picked") == {"iop.node": "node", "iop.attempt": 1}
    edge_span.event("run accepted")
    edge_span.event("first token")
    assert edge_span.event("end") == {"iop.end_cause": "node"}
    names = [name for name, _ in edge_span.events]
    assert names.index("run accepted") < names.index("first token") < names.index("end")
    for span in spans:
        assert "gen_ai.input.messages" not in span.attributes
        assert "gen_ai.output.messages" not in span.attributes

    assert node_span.name == "chat sim-echo"
    assert node_span.attributes["iop.run_id"] == a["iop.run_id"]
    assert node_span.attributes["iop.outcome"] == "complete"
    assert upstream_call.attributes["http.response.status_code"] == 200
    assert upstream_call.attributes["url.full"].endswith("/v1/chat/completions")
    assert upstream_edge.name == "chat sim-echo"
    assert upstream_sim.attributes["rpc.method"] == "Run"


async def test_one_trace_through_an_openai_node_the_edge_relays(tmp_path: Path) -> None:
    """An `openai+http://` node's run is relayed by the edge itself: one trace still, with
    the node's run span INTERNAL in the edge's process (no Run call, no `rpc.*`), the child
    of the edge's span and the parent of the request to the model server, which got the
    traceparent header."""
    traceparent, trace_id, _ = _traceparent()
    with otlp_receiver() as receiver:
        upstream_port = free_port()
        upstream_toml = _EDGE_CONFIG.format(
            port=upstream_port, refresh=5, node_name="sim", address="embedded"
        )
        async with edge_process(
            tmp_path, upstream_toml, env=_env(receiver, "upstream"), name="upstream"
        ):
            address = f"openai+http://127.0.0.1:{upstream_port}/v1"
            edge_toml = _EDGE_CONFIG.format(port=0, refresh=0.1, node_name="node", address=address)
            async with edge_process(
                tmp_path, edge_toml, env=_env(receiver, "edge"), name="edge"
            ) as edge:
                await _stream_once(edge.url, traceparent)
                spans = await receiver.wait_spans(trace_id, 5)

    edge_span = _one(spans, "edge", "server")
    run_span = _one(spans, "edge", "internal")
    upstream_call = _one(spans, "edge", "client")
    (upstream_edge,) = [
        s for s in spans if s.service == "upstream" and "http.request.method" in s.attributes
    ]
    assert {s.trace_id for s in spans} == {trace_id}
    assert run_span.parent_span_id == edge_span.span_id
    assert upstream_call.parent_span_id == run_span.span_id
    assert upstream_edge.parent_span_id == upstream_call.span_id  # the header reached it
    assert run_span.name == "chat sim-echo"
    assert run_span.attributes["iop.run_id"] == edge_span.attributes["iop.run_id"]
    assert run_span.attributes["iop.outcome"] == "complete"
    assert not any(key.startswith("rpc.") for key in run_span.attributes)
    assert upstream_call.attributes["http.response.status_code"] == 200


async def _stream_once(url: str, traceparent: str) -> None:
    body = {
        "model": "sim-echo",
        "stream": True,
        "temperature": 0.5,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "one two three"}],
    }
    async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
        # The edge learns the node's models on its first refresh: wait for /readyz.
        with trio.fail_after(WAIT_S):
            while (await client.get("/readyz")).status_code != 200:  # noqa: ASYNC110 - a process
                await trio.sleep(0.05)
        async with client.stream(
            "POST", CHAT, json=body, headers={"traceparent": traceparent}
        ) as response:
            assert response.status_code == 200
            text = "".join([line async for line in response.aiter_lines()])
    assert "data: [DONE]" in text


# --- in this process: an edge with tracing on, an edge with it off ----------------


@pytest.fixture
async def traced(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[RunningEdge, OtlpReceiver]]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    with otlp_receiver() as receiver:
        config = Config(
            server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
            nodes=(NodeConfig("embedded", "embedded"),),
            tracing=TracingConfig(enabled=True, endpoint=receiver.url, capture_content=True),
        )
        running = await start_edge(nursery, config)
        yield running, receiver
        await stop_edge(running)


async def test_spans_of_the_three_apis_capture_and_errors(
    traced: tuple[RunningEdge, OtlpReceiver],
) -> None:
    """With capture_content on, the span holds the prompt and the answer; each API's span
    says its API and response id; a run the node failed has error.type and an error status;
    a refused request (unknown model) has its error's type."""
    edge, receiver = traced
    async with httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as client:
        spans: dict[str, ReceivedSpan] = {}
        requests = {
            "chat": (CHAT, {"messages": [{"role": "user", "content": "hello there"}]}),
            "responses": ("/v1/responses", {"input": "hello there"}),
            "messages": (
                "/v1/messages",
                {"max_tokens": 20, "messages": [{"role": "user", "content": "hello there"}]},
            ),
        }
        for api, (path, body) in requests.items():
            traceparent, trace_id, _ = _traceparent()
            response = await client.post(
                path, json={"model": "sim-echo", **body}, headers={"traceparent": traceparent}
            )
            assert response.status_code == 200, response.text
            (spans[api],) = [
                s for s in await receiver.wait_spans(trace_id, 2) if "iop.api" in s.attributes
            ]
        failing = script({"type": "delta", "delta": "x"}, {"type": "error", "error": "boom"})
        traceparent, failed_trace, _ = _traceparent()
        response = await client.post(
            CHAT,
            json={"model": "sim-script", "messages": [{"role": "user", "content": failing}]},
            headers={"traceparent": traceparent},
        )
        assert response.status_code == 502
        traceparent, refused_trace, _ = _traceparent()
        response = await client.post(
            CHAT,
            json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
            headers={"traceparent": traceparent},
        )
        assert response.status_code == 404

    chat = spans["chat"].attributes
    (prompt,) = json.loads(chat["gen_ai.input.messages"])
    assert prompt["role"] == "user"
    assert prompt["parts"] == [{"type": "text", "content": "hello there"}]
    (answer,) = json.loads(chat["gen_ai.output.messages"])
    assert answer["parts"] == [{"type": "text", "content": "hello there"}]
    assert answer["finish_reason"] == "stop"
    assert chat["iop.stream"] is False
    for api, prefix in (("chat", "chatcmpl-"), ("responses", "resp_"), ("messages", "msg_")):
        attributes = spans[api].attributes
        assert attributes["iop.api"] == api
        assert attributes["gen_ai.response.id"] == prefix + attributes["iop.run_id"]
        assert spans[api].name == "chat sim-echo"
    assert spans["messages"].attributes["gen_ai.request.max_tokens"] == 20

    (failed,) = [s for s in await receiver.wait_spans(failed_trace, 2) if "iop.api" in s.attributes]
    assert failed.attributes["error.type"] == "run_error"
    assert failed.status_code == 2
    assert failed.attributes["http.response.status_code"] == 502
    (refused,) = await receiver.wait_spans(refused_trace, 1)
    assert refused.attributes["error.type"] == "invalid_request_error"
    assert refused.attributes["iop.error.code"] == "model_not_found"
    assert refused.attributes["http.response.status_code"] == 404
    assert refused.name == "chat no-such-model"


async def test_client_gone_is_the_end_cause(traced: tuple[RunningEdge, OtlpReceiver]) -> None:
    """A client that leaves mid-stream: the span's end event says so, and error.type is
    `cancelled` without an error status (the caller's choice, not a failure)."""
    edge, receiver = traced
    traceparent, trace_id, _ = _traceparent()
    hang = script({"type": "delta", "delta": "x"}, {"type": "hang"})
    body = {"model": "sim-script", "stream": True, "messages": [{"role": "user", "content": hang}]}
    async with (
        httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as client,
        client.stream("POST", CHAT, json=body, headers={"traceparent": traceparent}) as response,
    ):
        async for line in response.aiter_lines():
            if '"content":"x"' in line:
                break
    (span,) = [s for s in await receiver.wait_spans(trace_id, 2) if "iop.api" in s.attributes]
    assert span.event("end") == {"iop.end_cause": "client_disconnected"}
    assert span.attributes["error.type"] == "cancelled"
    assert span.status_code == 0
    node_spans = [s for s in receiver.trace(trace_id) if s is not span]
    assert node_spans[0].attributes["iop.outcome"] == "cancelled"


async def test_tracing_off_makes_no_exporter(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With tracing off (the default) the edge has no tracer, its requests no span, and its
    /metrics says so (iop_edge_tracing 0); an OTLP endpoint in the environment alone does
    not turn it on, and nothing reaches it."""
    with otlp_receiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
        edge = await start_edge(
            nursery, Config(server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0))
        )
        traceparent, _, _ = _traceparent()
        async with httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as client:
            response = await client.post(
                CHAT,
                json={"model": "sim-echo", "messages": [{"role": "user", "content": "hi"}]},
                headers={"traceparent": traceparent},
            )
            assert response.status_code == 200
            metrics = (await client.get("/metrics")).text
        assert edge.edge.chat.tracing is None
        assert "\niop_edge_tracing 0.0\n" in metrics
        await stop_edge(edge)
        assert receiver.requests == 0


async def test_captured_output_is_bounded(traced: tuple[RunningEdge, OtlpReceiver]) -> None:
    """A long answer with capture_content on: the span keeps at most MAX_CAPTURED_CHARS of
    it, and the client gets all of it (what the edge holds meanwhile: tests/unit)."""
    edge, receiver = traced
    traceparent, trace_id, _ = _traceparent()
    long = script(
        {"type": "delta", "delta": "y" * 1000, "repeat": 100},
        {"type": "complete", "metadata": {"finish_reason": "stop"}},
    )
    body = {"model": "sim-script", "messages": [{"role": "user", "content": long}]}
    async with httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as client:
        response = await client.post(CHAT, json=body, headers={"traceparent": traceparent})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["message"]["content"]) == 100_000
    (span,) = [s for s in await receiver.wait_spans(trace_id, 2) if "iop.api" in s.attributes]
    captured = span.attributes["gen_ai.output.messages"]
    assert MAX_CAPTURED_CHARS <= len(captured) <= MAX_CAPTURED_CHARS + 3
    assert captured.endswith("...")
