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
    """SIGHUP (a reload of the same file) then SIGUSR1 and SIGUSR2 mid-stream: one log line
    each, the edge keeps serving (SIGPIPE too), the stream finishes with [DONE]; then
    SIGTERM drains and exits 0."""
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
            edge.signal(signal.SIGHUP)
            await edge.wait_line("configuration reloaded from .*: nothing changed")
            for signum in (signal.SIGUSR1, signal.SIGUSR2):
                edge.signal(signum)
                await edge.wait_line(rf"{signal.Signals(signum).name}: ignored")
            edge.signal(signal.SIGPIPE)  # ignored as Python sets it: no line, no exit
            assert (await http.get("/healthz")).status_code == 200
            rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
        assert (await http.get("/healthz")).status_code == 200
        edge.signal(signal.SIGTERM)
        assert await edge.wait_exit() == 0
    for name in ("SIGUSR1", "SIGUSR2"):
        assert sum(f"{name}: ignored" in line for line in edge.lines) == 1
    assert sum("configuration reloaded" in line for line in edge.lines) == 1


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


def media_body(*urls: str, key: str = "image_url") -> dict[str, Any]:
    """An echo request whose user message carries one media part per URL."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": script({"type": "request"}, COMPLETE)}]
    parts += [{"type": key, key: {"url": url}} for url in urls]
    return {"model": "sim-script", "messages": [{"role": "user", "content": parts}]}


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


async def test_default_policy_caps_tokens_and_drops_template_and_ignore_eos(
    edge: RunningEdge, http: httpx.AsyncClient
) -> None:
    """Defaults: max_tokens over 131072 is a 400 naming the cap; under it, or absent, it
    reaches the node as sent (nothing invented); chat_template and ignore_eos never reach
    the node, the other chat_template_kwargs do."""
    error = error_of(await http.post(CHAT, json=echo_body(max_tokens=2**32 - 1)))
    assert error["param"] == "max_tokens"
    assert "at most 131072" in error["message"]
    error = error_of(await http.post(CHAT, json=echo_body(max_completion_tokens=131_073)))
    assert "at most 131072" in error["message"]
    assert (await received(http, echo_body(max_tokens=131_072)))["maxTokens"] == 131_072
    assert "maxTokens" not in await received(http, echo_body())
    sent = await received(
        http,
        echo_body(
            chat_template_kwargs={"chat_template": "{{ 7*7 }}", "enable_thinking": False},
            ignore_eos=True,
            top_k=5,
        ),
    )
    assert json.loads(sent["extraJson"]) == {
        "chat_template_kwargs": {"enable_thinking": False},
        "top_k": 5,
    }
    only_template = echo_body(chat_template_kwargs={"chat_template": "x"})
    assert "extraJson" not in await received(http, only_template)


async def test_a_model_table_sets_its_own_policy(nursery: trio.Nursery, sim: SimProcess) -> None:
    """[models.sim-script] with max_output_tokens = 1000, allow_chat_template and
    allow_ignore_eos: 1001 tokens (or min_tokens) is a 400 naming 1000; the template and
    ignore_eos reach the node as sent."""
    model = ModelConfig(max_output_tokens=1000, allow_chat_template=True, allow_ignore_eos=True)
    running = await start_edge(nursery, with_models(sim, **{"sim-script": model}))
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        error = error_of(await http.post(CHAT, json=echo_body(max_tokens=1001)))
        assert (error["param"], error["code"]) == ("max_tokens", "invalid_value")
        assert "at most 1000 completion tokens" in error["message"]
        error = error_of(await http.post(CHAT, json=echo_body(min_tokens=1001)))
        assert error["param"] == "min_tokens"
        kwargs = {"chat_template": "{{ 7*7 }}"}
        sent = await received(
            http, echo_body(max_tokens=1000, chat_template_kwargs=kwargs, ignore_eos=True)
        )
        assert sent["maxTokens"] == 1000
        assert json.loads(sent["extraJson"]) == {"chat_template_kwargs": kwargs, "ignore_eos": True}
    await stop_edge(running)


async def test_media_urls_data_only_by_default(edge: RunningEdge, http: httpx.AsyncClient) -> None:
    """By default a data: URL reaches the node as sent; http(s), file:, ftp:, javascript:
    and a scheme hidden behind a blank are 400s naming the part's param path."""
    image = "data:image/png;base64,iVBORw0KGgo="
    sent = await received(http, media_body(image))
    assert json.loads(sent["messages"][0]["parts"][1]["json"])["image_url"]["url"] == image
    for url in (
        "https://example.com/cat.png",
        "http://169.254.169.254/latest/meta-data/",
        "file:///etc/passwd",
        "FTP://example.com/x",
        "javascript:alert(1)",
        " file:///etc/passwd",
        "/etc/passwd",
    ):
        error = error_of(await http.post(CHAT, json=media_body(image, url)))
        assert error["param"] == "messages[0].content[2].image_url.url", url
    error = error_of(await http.post(CHAT, json=media_body("gopher://x/", key="video_url")))
    assert error["param"] == "messages[0].content[1].video_url.url"
    file_part = {"type": "file", "file": {"file_data": "file:///etc/passwd"}}
    body = media_body()
    body["messages"][0]["content"].append(file_part)
    assert error_of(await http.post(CHAT, json=body))["param"] == (
        "messages[0].content[1].file.file_data"
    )


async def test_https_media_when_the_model_allows_it(nursery: trio.Nursery, sim: SimProcess) -> None:
    """media_url_schemes = ["https"]: https URLs reach the node; http and file: do not."""
    model = ModelConfig(media_url_schemes=("https",))
    running = await start_edge(nursery, with_models(sim, **{"sim-script": model}))
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        url = "https://example.com/cat.png"
        sent = await received(http, media_body(url, "data:image/png;base64,AAAA"))
        assert json.loads(sent["messages"][0]["parts"][1]["json"])["image_url"]["url"] == url
        for refused in ("http://example.com/cat.png", "file:///etc/passwd"):
            error = error_of(await http.post(CHAT, json=media_body(refused)))
            assert error["param"] == "messages[0].content[1].image_url.url"
    await stop_edge(running)


async def test_dropped_fields_are_logged_at_debug(sim: SimProcess, tmp_path: Path) -> None:
    """With [log] level = "DEBUG", a request whose template and ignore_eos were dropped
    leaves one debug line naming both (with its request id and model)."""
    toml = node_toml(sim) + '[log]\nlevel = "DEBUG"\n'
    async with (
        edge_process(tmp_path, toml) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as http,
    ):
        body = echo_body(chat_template_kwargs={"chat_template": "x"}, ignore_eos=True)
        response = await http.post(CHAT, json=body, headers={"X-Request-Id": "drop-1"})
        assert response.status_code == 200
        line = await edge.wait_line(r"not forwarded to the node")
    assert "chat_template_kwargs.chat_template, ignore_eos" in line
    assert "DEBUG" in line
    assert "drop-1" in line
    assert "sim-script" in line
