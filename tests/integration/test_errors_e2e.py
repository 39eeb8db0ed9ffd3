"""Bad input gets an OpenAI-shaped error with the right status, over a real socket."""

from __future__ import annotations

import re

import httpx
import pytest
import trio

from edge.config import Config, NodeConfig, RoutingConfig, ServerConfig
from tests.integration.conftest import SimProcess, chat_body, script, start_edge, stop_edge
from tests.integration.edgeproc import free_port

CHAT = "/v1/chat/completions"


def _assert_error(response: httpx.Response, status: int, error_type: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type
    assert isinstance(error["message"], str)
    assert error["message"]
    assert "Traceback" not in error["message"]
    return error  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b"", None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "sim-echo"}', "messages"),
        (
            b'{"model": "sim-echo", "messages": [{"role": "user", "content": 5}]}',
            "messages[0].content",
        ),
        (
            b'{"model": "sim-echo", "messages": [{"role": "wizard", "content": "x"}]}',
            "messages[0].role",
        ),
        (b'{"model": "sim-echo", "messages": [{"role": "user", "content": "x"}], "n": 2}', "n"),
        (
            b'{"model": "sim-echo", "messages": [{"role": "user", "content": "x"}],'
            b' "tools": [{"type": "function", "function": {"name": "bad name!"}}]}',
            None,
        ),
    ],
)
async def test_bad_requests_are_400(
    http: httpx.AsyncClient, body: bytes, param: str | None
) -> None:
    """Malformed JSON, wrong types, missing fields: 400 invalid_request_error naming the param."""
    response = await http.post(CHAT, content=body, headers={"content-type": "application/json"})
    error = _assert_error(response, 400, "invalid_request_error")
    if param is not None:
        assert error["param"] == param


async def test_unknown_model_is_404(http: httpx.AsyncClient) -> None:
    """A model no node serves: 404 model_not_found."""
    response = await http.post(
        CHAT, json={"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}
    )
    error = _assert_error(response, 404, "invalid_request_error")
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


async def test_wrong_method_is_405(http: httpx.AsyncClient) -> None:
    """GET on the chat endpoint: 405 in OpenAI's error shape."""
    _assert_error(await http.get(CHAT), 405, "invalid_request_error")


async def test_unknown_path_is_404(http: httpx.AsyncClient) -> None:
    _assert_error(await http.get("/v1/nope"), 404, "invalid_request_error")


async def test_oversize_body_is_413(http: httpx.AsyncClient) -> None:
    """A body over max_body_bytes: 413 before anything is parsed."""
    big = (
        b'{"model": "sim-echo", "messages": [{"role": "user", "content": "'
        + b"x" * (5 * 1024 * 1024)
        + b'"}]}'
    )
    response = await http.post(CHAT, content=big, headers={"content-type": "application/json"})
    _assert_error(response, 413, "invalid_request_error")


async def test_no_node_reachable_is_503_before_any_byte(nursery: trio.Nursery) -> None:
    """With every node down, a streaming request gets a 503 JSON error, not a broken stream."""
    config = Config(
        server=ServerConfig(listen="127.0.0.1:0"), nodes=(NodeConfig("down", "127.0.0.1:1"),)
    )
    running = await start_edge(nursery, config)
    async with httpx.AsyncClient(base_url=running.url) as client:
        response = await client.post(
            CHAT,
            json={
                "model": "sim-echo",
                "stream": True,
                "messages": [{"role": "user", "content": "x"}],
            },
        )
        _assert_error(response, 503, "node_unavailable")
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert "reason" in ready.json()
    await stop_edge(running)


async def test_the_503_says_why_no_node_could_take_the_model(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """The 503's message says why: a model server that does not answer (`--node
    openai+http://...` pointing at nothing) is a node down and the reason it gave, in the
    request's error, not only in /readyz and the log; a node up that serves other models
    is named as such; a node whose breaker opened, for how long yet."""
    nowhere = f"openai+http://127.0.0.1:{free_port()}/v1"
    config = Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
        routing=RoutingConfig(retries=0, breaker_failures=1, breaker_cooldown_s=60.0),
        nodes=(NodeConfig("upstream", nowhere), NodeConfig("sim", sim.address)),
    )
    running = await start_edge(nursery, config)
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
        body = {"model": "qwen3-8b", "messages": [{"role": "user", "content": "x"}]}
        for stream in (False, True):
            response = await client.post(CHAT, json={**body, "stream": stream})
            error = _assert_error(response, 503, "node_unavailable")
            assert error["message"] == (
                "no node is available for model 'qwen3-8b': node 'upstream' is down (node"
                f" {nowhere} is unavailable: UNAVAILABLE: upstream {nowhere[7:]}/models is"
                " unreachable: All connection attempts failed); up but not serving it:"
                " node 'sim'; retry later"
            )
        failing = {"type": "error", "error": "GPU fell over"}
        failed = await client.post(CHAT, json=chat_body("sim-script", script(failing)))
        _assert_error(failed, 502, "run_error")
        response = await client.post(CHAT, json=chat_body("sim-echo", "hi"))
        message = _assert_error(response, 503, "node_unavailable")["message"]
        assert isinstance(message, str)
        opened = re.search(r"node 'sim' has its circuit breaker open for ([\d.]+)s more", message)
        assert opened is not None, message
        assert 30 < float(opened.group(1)) <= 60  # the cooldown, less the moments since
        assert "(after 1 failed run(s) in a row)" in message
        assert "node 'upstream' is down" in message
    await stop_edge(running)
