"""End to end: CORS over a real socket (httpx), as a browser would send it: preflights
answered before the API key, and the headers on real answers (errors and SSE streams
included) for the origins `[server] cors_allow_origins` lists, and for no other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
import trio

from edge.http.cors import DEFAULT_HEADERS
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    edge_config,
    start_edge,
    stop_edge,
)

ORIGIN = "https://app.example.com"
KEY = "sk-browser"
CHAT = "/v1/chat/completions"


def _preflight(origin: str, method: str = "POST", headers: str | None = None) -> dict[str, str]:
    asked = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        asked["Access-Control-Request-Headers"] = headers
    return asked


async def _edge(
    nursery: trio.Nursery, sim: SimProcess, origins: tuple[str, ...], keys: tuple[str, ...] = ()
) -> RunningEdge:
    config = edge_config(sim)
    server = replace(config.server, cors_allow_origins=origins, api_keys=keys)
    return await start_edge(nursery, replace(config, server=server))


@pytest.fixture
async def browser(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[httpx.AsyncClient]:
    """An edge that allows ORIGIN and asks for a key, and a client of it."""
    running = await _edge(nursery, sim, (ORIGIN,), (KEY,))
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
        yield client
    await stop_edge(running)


async def test_preflight_is_answered_before_the_key(browser: httpx.AsyncClient) -> None:
    """A preflight (no key: browsers send none) is 204 with the path's methods, the asked
    headers echoed, a max age and Vary; it starts no request (none counted)."""
    asked = "authorization, content-type, x-stainless-os, anthropic-version"
    response = await browser.options(CHAT, headers=_preflight(ORIGIN, headers=asked))
    assert response.status_code == 204
    assert response.content == b""
    h = response.headers
    assert h["access-control-allow-origin"] == ORIGIN
    assert h["access-control-allow-methods"] == "POST"
    assert h["access-control-allow-headers"] == asked
    assert int(h["access-control-max-age"]) > 0
    assert "Origin" in h["vary"]
    assert "access-control-allow-credentials" not in h
    models = await browser.options("/v1/models/org/name", headers=_preflight(ORIGIN, "GET"))
    assert models.status_code == 204
    assert "GET" in models.headers["access-control-allow-methods"]
    odd = await browser.options(CHAT, headers=_preflight(ORIGIN, headers="x-a, bad header!"))
    assert odd.headers["access-control-allow-headers"] == DEFAULT_HEADERS
    metrics = (await browser.get("/metrics")).text
    assert "iop_edge_requests_total{" not in metrics


async def test_other_origins_get_no_cors_headers(browser: httpx.AsyncClient) -> None:
    """An origin not listed: its preflight is handled as any request (here, no key: 401)
    and no answer carries a CORS header; a preflight to an unknown path is no 204."""
    denied = await browser.options(CHAT, headers=_preflight("https://evil.example"))
    assert denied.status_code == 401
    assert not [h for h in denied.headers if h.startswith("access-control-")]
    answer = await browser.get(
        "/v1/models", headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"}
    )
    assert answer.status_code == 200
    assert "access-control-allow-origin" not in answer.headers
    unknown = await browser.options("/v1/nope", headers=_preflight(ORIGIN))
    assert unknown.status_code != 204


async def test_streams_and_errors_carry_the_headers(browser: httpx.AsyncClient) -> None:
    """A real SSE answer and an error (no key: 401) to the allowed origin both carry
    Allow-Origin, Vary: Origin and the exposed headers clients read."""
    body = chat_body("sim-echo", "hello browser", stream=True)
    headers = {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    async with browser.stream("POST", CHAT, json=body, headers=headers) as response:
        assert response.status_code == 200
        stream_headers = response.headers
        raw = (await response.aread()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    error = await browser.post(CHAT, json=body, headers={"Origin": ORIGIN})
    assert error.status_code == 401
    for h in (stream_headers, error.headers):
        assert h["access-control-allow-origin"] == ORIGIN
        assert "Origin" in h["vary"]
        exposed = {name.strip() for name in h["access-control-expose-headers"].split(",")}
        assert {"x-request-id", "retry-after", "x-ratelimit-remaining-requests"} <= exposed


async def test_any_origin_and_none(nursery: trio.Nursery, sim: SimProcess) -> None:
    """With "*": Allow-Origin "*" and no Vary on Origin. With no origins (the default):
    no CORS header at all, and OPTIONS is the 405 it always was."""
    anyone = await _edge(nursery, sim, ("*",))
    closed = await _edge(nursery, sim, ())
    async with httpx.AsyncClient(timeout=30) as http:
        preflight = await http.options(anyone.url + CHAT, headers=_preflight("https://x.example"))
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == "*"
        answer = await http.get(anyone.url + "/v1/models", headers={"Origin": "https://x.example"})
        assert answer.headers["access-control-allow-origin"] == "*"
        assert "Origin" not in answer.headers.get("vary", "")
        refused = await http.options(closed.url + CHAT, headers=_preflight(ORIGIN))
        assert refused.status_code == 405
        plain = await http.get(closed.url + "/v1/models", headers={"Origin": ORIGIN})
        for response in (refused, plain):
            assert not [h for h in response.headers if h.startswith("access-control-")]
            assert "vary" not in response.headers
    await stop_edge(anyone)
    await stop_edge(closed)
