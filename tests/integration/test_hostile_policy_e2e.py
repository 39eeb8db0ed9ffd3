"""Hostile input at the edge's front, over real sockets and real processes.

Log forging, the auth scheme's case, path oddities, process signals, and the
per-model forwarding policy (what the node receives). The node is a real
`iop-sim-node` process; where the process itself is the subject (its log
lines, its signals) the edge is the `iop-edge` console script too.
"""

from __future__ import annotations

import json
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.config import Config, ModelConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    edge_config,
    script,
    start_edge,
    stop_edge,
)
from tests.integration.edgeproc import edge_process

CHAT = "/v1/chat/completions"
COMPLETE = {"type": "complete", "metadata": {"finish_reason": "stop"}}


# --- helpers ------------------------------------------------------------------


def node_toml(sim: SimProcess, *, server: str = "") -> str:
    return (
        f'[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n{server}\n'
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
    )


async def raw_exchange(url: str, head: bytes, body: bytes = b"") -> tuple[int, bytes, bytes]:
    """Send one request as bytes (target as written, no client normalizing it) on a fresh
    connection with `Connection: close`; returns (status, header block, body)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(head + b"\r\nConnection: close\r\n\r\n" + body)
        received = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                received += chunk
    header_block, _, payload = received.partition(b"\r\n\r\n")
    status = int(header_block.split(b" ", 2)[1])
    return status, header_block, payload


def assert_json_404(status: int, headers: bytes, payload: bytes) -> None:
    assert status == 404, (headers, payload)
    assert b"\r\nlocation:" not in headers.lower()
    body = json.loads(payload)
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "not_found"


def with_models(sim: SimProcess, **models: ModelConfig) -> Config:
    return replace(edge_config(sim), models=models)


# --- log forging --------------------------------------------------------------


async def test_text_logs_escape_control_characters_from_clients(
    sim: SimProcess, tmp_path: Path
) -> None:
    """A path with %0A and %1B, a method-like target and a model name with a newline and
    an escape write no forged line and no raw control byte: each appears escaped."""
    async with edge_process(tmp_path, node_toml(sim)) as edge:
        status, _, _ = await raw_exchange(
            edge.url, b"GET /v1/x%0AFORGED-PATH%1B[31m%E2%80%A8 HTTP/1.1\r\nHost: x"
        )
        assert status == 404
        body = json.dumps(chat_body("no\nFORGED-MODEL\x1b[2J", "hi")).encode()
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        head += b"\r\nContent-Length: " + str(len(body)).encode()
        status, _, _ = await raw_exchange(edge.url, head, body)
        assert status == 404  # no node serves that model
        async with httpx.AsyncClient(base_url=edge.url) as http:
            assert (await http.get("/healthz")).status_code == 200
        await edge.wait_line(r"GET /healthz 200")  # lines are written in order
    text = edge.stderr
    assert "\x1b" not in text
    assert "\u2028" not in text
    assert not any(line.startswith("FORGED") for line in text.splitlines())
    assert any("/v1/x\\nFORGED-PATH\\x1b[31m\\u2028 404" in line for line in edge.lines)


# --- auth ---------------------------------------------------------------------


async def test_the_bearer_scheme_is_case_insensitive(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """`bearer`, `BEARER` and extra spaces are accepted; a wrong scheme or key is a 401."""
    config = edge_config(sim)
    config = replace(config, server=replace(config.server, api_keys=("sk-test",)))
    running = await start_edge(nursery, config)
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        for header in ("Bearer sk-test", "bearer sk-test", "BEARER  sk-test", "bEaReR sk-test"):
            response = await http.get("/v1/models", headers={"Authorization": header})
            assert response.status_code == 200, header
        for header in ("Basic sk-test", "Bearersk-test", "bearer sk-tesT", "bearer", "sk-test"):
            response = await http.get("/v1/models", headers={"Authorization": header})
            assert response.status_code == 401, header
            assert response.json()["error"]["code"] == "invalid_api_key"
    await stop_edge(running)


# --- paths --------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        b"/v1//chat/completions",
        b"//v1/chat/completions",
        b"/v1/chat/completions/",
        b"/v1/chat/completions//",
        b"/v1/chat%2Fcompletions",
        b"/v1%2Fchat%2Fcompletions",
        b"/v1/chat/c%6Fmpletions",
        b"/v1/../v1/chat/completions",
        b"/v1/./chat/completions",
        b"http://evil.example/v1/chat/completions",
    ],
)
async def test_path_oddities_get_the_json_404_never_a_redirect(
    edge: RunningEdge, target: bytes
) -> None:
    """Every target that is not exactly the route is the JSON 404 with no Location (none
    built from the Host header), whatever the method."""
    body = json.dumps(chat_body("sim-echo", "hi")).encode()
    head = b"POST " + target + b" HTTP/1.1\r\nHost: evil.example\r\nContent-Type: application/json"
    head += b"\r\nContent-Length: " + str(len(body)).encode()
    assert_json_404(*(await raw_exchange(edge.url, head, body)))
    get = b"GET " + target.replace(b"chat/completions", b"models") + b" HTTP/1.1\r\nHost: e"
    assert_json_404(*(await raw_exchange(edge.url, get)))


async def test_the_plain_routes_still_answer(edge: RunningEdge) -> None:
    """The same raw client reaches the real routes (the 404s above are not the client's)."""
    assert (await raw_exchange(edge.url, b"GET /v1/models HTTP/1.1\r\nHost: x"))[0] == 200
    assert (await raw_exchange(edge.url, b"GET /healthz?x=1 HTTP/1.1\r\nHost: x"))[0] == 200


# --- signals ------------------------------------------------------------------


async def test_sighup_and_sigusr1_are_logged_and_ignored(sim: SimProcess, tmp_path: Path) -> None:
    """SIGHUP then SIGUSR1 (and SIGUSR2) mid-stream: one log line each, the edge keeps
    serving, the stream finishes with [DONE]; then SIGTERM drains and exits 0."""
    items = [{"type": "delta", "delta": "a"}, {"sleep_ms": 200}]
    items += [{"type": "delta", "delta": "b"}, COMPLETE]
    body = chat_body("sim-script", script(*items), stream=True)
    async with (
        edge_process(tmp_path, node_toml(sim)) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as http,
    ):
        async with http.stream("POST", CHAT, json=body) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if '"content":"a"' in line:
                    break
            for signum in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
                edge.signal(signum)
                await edge.wait_line(rf"{signal.Signals(signum).name}: ignored")
            assert (await http.get("/healthz")).status_code == 200
            rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
        assert (await http.get("/healthz")).status_code == 200
        edge.signal(signal.SIGTERM)
        assert await edge.wait_exit() == 0
    for name in ("SIGHUP", "SIGUSR1", "SIGUSR2"):
        assert sum(f"{name}: ignored" in line for line in edge.lines) == 1


# --- forwarding policy --------------------------------------------------------


def echo_body(model: str = "sim-script", **extra: Any) -> dict[str, Any]:
    """A non-streaming sim-script request whose answer is the RunRequest the node got."""
    return chat_body(model, script({"type": "request"}, COMPLETE), **extra)


async def received(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """The RunRequest (protobuf JSON) the node received for `body`."""
    response = await http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"]
    request: dict[str, Any] = json.loads(content)
    return request
