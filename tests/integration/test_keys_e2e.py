"""API keys with names and limits over a real edge (counters in this process) and a real
node process: allow-lists, the rate-limit headers, rpm, tpm and max_streams.

The window is anchored on a key's first request (edge.limits.window), so nothing here
depends on clock minutes; expectations come from the counts and the reset header. Waits
are bounded polls on in-process state.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import h11
import httpx
import openai
import pytest
import trio

from edge.config import Config, KeyConfig, NodeConfig, ServerConfig
from edge.http import connection
from edge.limits.limiter import legacy_name
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    poll,
    script,
    start_edge,
    stop_edge,
)
from tests.integration.edgeproc import edge_process
from tests.integration.rawhttp import read_response

CHAT = "/v1/chat/completions"
KEYS = (
    KeyConfig("team-a", "sk-team-a", rpm=3, models=("sim-echo",)),
    KeyConfig("tokens", "sk-tokens", tpm=100),
    KeyConfig("streams", "sk-streams", max_streams=2),
    KeyConfig("free", "sk-free"),
)
RATE_HEADERS = (
    "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
)  # fmt: skip
HOLD = chat_body("sim-script", script({"type": "delta", "delta": "x"}, {"type": "hang"}),
                 stream=True)  # fmt: skip


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
async def keyed(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[RunningEdge]:
    config = Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0, api_keys=("sk-legacy",)),
        nodes=(NodeConfig("sim", sim.address),),
        keys=KEYS,
    )
    running = await start_edge(nursery, config)
    yield running
    await stop_edge(running)


@pytest.fixture
async def client(keyed: RunningEdge) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30) as http:
        yield http


def _sample(edge: RunningEdge, name: str, **labels: str) -> float:
    return edge.edge.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_allow_list_answers_like_a_missing_model_and_filters_models(
    keyed: RunningEdge, client: httpx.AsyncClient
) -> None:
    """A model outside the key's allow-list is 404 model_not_found with the message of a
    model that does not exist, is not counted against rpm, and /v1/models lists only the
    key's models; other keys (and the legacy api_keys) see every model."""
    listed = await client.get("/v1/models", headers=_auth("sk-team-a"))
    assert [m["id"] for m in listed.json()["data"]] == ["sim-echo"]
    everything = {
        m["id"] for m in (await client.get("/v1/models", headers=_auth("sk-free"))).json()["data"]
    }
    assert {"sim-echo", "sim-script"} <= everything
    legacy = await client.get("/v1/models", headers=_auth("sk-legacy"))
    assert {m["id"] for m in legacy.json()["data"]} == everything

    refused = await client.post(
        CHAT, json=chat_body("sim-script", "{}"), headers=_auth("sk-team-a")
    )
    missing = await client.post(
        CHAT, json=chat_body("no-such-model", "x"), headers=_auth("sk-free")
    )
    assert refused.status_code == missing.status_code == 404
    error, other = refused.json()["error"], missing.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        other["type"], "model_not_found", "model",
    )  # fmt: skip
    assert error["message"] == other["message"].replace("no-such-model", "sim-script")
    assert _sample(keyed, "iop_edge_key_rejections_total", key="team-a", limit="model") == 1
    ok = await client.post(CHAT, json=chat_body("sim-echo", "hi"), headers=_auth("sk-team-a"))
    assert ok.headers["x-ratelimit-remaining-requests"] == "2"  # the 404 was not counted


async def test_rpm_headers_on_every_answer_and_429_through_the_sdk(
    keyed: RunningEdge, client: httpx.AsyncClient
) -> None:
    """rpm = 3: three answers (streamed too) carry the requests headers counting down, with
    the window's reset; the fourth is the SDK's RateLimitError: 429 rate_limit_exceeded,
    Retry-After and the same headers at 0 remaining. A key without limits gets none."""
    first = await client.post(CHAT, json=chat_body("sim-echo", "hi"), headers=_auth("sk-team-a"))
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "3"
    assert first.headers["x-ratelimit-remaining-requests"] == "2"
    assert first.headers["x-ratelimit-reset-requests"].endswith("s")
    assert "x-ratelimit-limit-tokens" not in first.headers  # this key has no tpm
    async with client.stream(
        "POST", CHAT, json=chat_body("sim-echo", "hi", stream=True), headers=_auth("sk-team-a")
    ) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["x-ratelimit-remaining-requests"] == "1"
        assert (await streamed.aread()).endswith(b"data: [DONE]\n\n")
    third = await client.post(CHAT, json=chat_body("sim-echo", "hi"), headers=_auth("sk-team-a"))
    assert third.headers["x-ratelimit-remaining-requests"] == "0"

    def over() -> openai.RateLimitError:
        sdk = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-team-a", max_retries=0)
        with sdk, pytest.raises(openai.RateLimitError) as info:
            sdk.chat.completions.create(
                model="sim-echo", messages=[{"role": "user", "content": "hi"}]
            )
        return info.value

    error = await trio.to_thread.run_sync(over)
    assert error.status_code == 429
    assert error.body["type"] == error.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    assert error.body["param"] is None  # type: ignore[index]
    headers = error.response.headers
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert _sample(keyed, "iop_edge_key_rejections_total", key="team-a", limit="requests") == 1
    assert _sample(keyed, "iop_edge_key_requests_total", key="team-a") == 3

    free = await client.post(CHAT, json=chat_body("sim-echo", "hi"), headers=_auth("sk-free"))
    assert free.status_code == 200
    assert not any(h in free.headers for h in RATE_HEADERS)


async def test_tpm_counts_each_runs_usage_when_it_ends(
    keyed: RunningEdge, client: httpx.AsyncClient
) -> None:
    """tpm = 100: a run that used 110 tokens is counted when it ends (before its answer's
    last byte), so the next request, sent right after, is refused over tokens."""
    usage = {"input_tokens": 60, "output_tokens": 50}
    used = script({"type": "delta", "delta": "x"}, {"type": "complete", "usage": usage})
    first = await client.post(CHAT, json=chat_body("sim-script", used), headers=_auth("sk-tokens"))
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    assert first.headers["x-ratelimit-remaining-tokens"] == "100"  # known when admitted
    second = await client.post(CHAT, json=chat_body("sim-echo", "x"), headers=_auth("sk-tokens"))
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "rate_limit_exceeded"
    assert second.headers["x-ratelimit-remaining-tokens"] == "0"
    assert _sample(keyed, "iop_edge_key_tokens_total", key="tokens", type="input") == 60
    assert _sample(keyed, "iop_edge_key_tokens_total", key="tokens", type="output") == 50


async def _hold(http: httpx.AsyncClient, held: list[str]) -> None:
    """A stream mid-answer that stays open until cancelled (its client leaves)."""
    async with http.stream("POST", CHAT, json=HOLD, headers=_auth("sk-streams")) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if '"content":"x"' in line:
                held.append(json.loads(line[6:])["id"])
                await trio.sleep_forever()


async def test_max_streams_holds_and_gives_back_on_disconnect(
    keyed: RunningEdge, client: httpx.AsyncClient
) -> None:
    """max_streams = 2: with two streams open the third request is 429 (Retry-After); a
    client that leaves gives its stream back, exactly once, and the next request passes."""
    held: list[str] = []
    async with trio.open_nursery() as holders:
        scopes = []
        for _ in range(2):
            scope = trio.CancelScope()
            scopes.append(scope)

            async def hold(scope: trio.CancelScope = scope) -> None:
                with scope:
                    await _hold(client, held)

            holders.start_soon(hold)
        await poll(lambda: len(held) == 2)
        refused = await client.post(CHAT, json=chat_body("sim-echo", "x"),
                                    headers=_auth("sk-streams"))  # fmt: skip
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        assert "in flight" in refused.json()["error"]["message"]
        scopes[0].cancel()  # one client leaves
        await poll(lambda: _sample(keyed, "iop_edge_key_streams", key="streams") == 1)
        passed = await client.post(CHAT, json=chat_body("sim-echo", "x"),
                                   headers=_auth("sk-streams"))  # fmt: skip
        assert passed.status_code == 200
        assert _sample(keyed, "iop_edge_key_streams", key="streams") == 1
        holders.cancel_scope.cancel()
    await poll(lambda: _sample(keyed, "iop_edge_key_streams", key="streams") == 0)
    assert _sample(keyed, "iop_edge_key_rejections_total", key="streams", limit="streams") == 1


async def test_unknown_keys_are_refused_and_the_key_is_never_a_label(
    keyed: RunningEdge, client: httpx.AsyncClient
) -> None:
    """A key that is not configured is 401; /metrics names keys, never their secrets."""
    wrong = await client.post(CHAT, json=chat_body("sim-echo", "x"), headers=_auth("sk-team-b"))
    assert wrong.status_code == 401
    await client.post(CHAT, json=chat_body("sim-echo", "x"), headers=_auth("sk-free"))
    metrics = (await client.get("/metrics")).text
    assert 'iop_edge_key_requests_total{key="free"} 1.0' in metrics
    assert not any(k.secret in metrics for k in KEYS)


async def test_workers_of_one_edge_share_limits_through_the_shared_dir(
    tmp_path: Path, sim: SimProcess
) -> None:
    """Two edge processes given one IOP_EDGE_SHARED_DIR (as the supervisor gives its
    workers) count one rpm = 3 between them: the 4th request, on either, is 429."""
    shared = tmp_path / "shared"
    shared.mkdir()
    toml = (
        '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
        '[[keys]]\nname = "w"\nkey = "sk-workers"\nrpm = 3\n'
    )
    env = {"IOP_EDGE_SHARED_DIR": str(shared)}
    async with (
        edge_process(tmp_path, toml, env=env, name="w1") as w1,
        edge_process(tmp_path, toml, env=env, name="w2") as w2,
        httpx.AsyncClient(timeout=30) as http,
    ):
        statuses = []
        for i in range(5):
            url = (w1, w2)[i % 2].url + CHAT
            answer = await http.post(
                url, json=chat_body("sim-echo", "x"), headers=_auth("sk-workers")
            )
            statuses.append(answer.status_code)
        assert statuses == [200, 200, 200, 429, 429]
        await w1.wait_line("counted in shared")


async def test_keys_without_limits_are_counted_by_name(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """An edge whose keys have no limits (so no store): the allow-list still applies, and
    requests and tokens are counted by key name; no rate-limit headers are sent."""
    config = Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0, api_keys=("sk-legacy",)),
        nodes=(NodeConfig("sim", sim.address),),
        keys=(KeyConfig("only-models", "sk-m", models=("sim-echo",)),),
    )
    running = await start_edge(nursery, config)
    try:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            refused = await http.post(
                CHAT, json=chat_body("sim-script", "{}"), headers=_auth("sk-m")
            )
            assert refused.status_code == 404
            ok = await http.post(CHAT, json=chat_body("sim-echo", "a b"), headers=_auth("sk-m"))
            assert ok.status_code == 200
            assert not any(h in ok.headers for h in RATE_HEADERS)
            legacy = await http.post(
                CHAT, json=chat_body("sim-echo", "a"), headers=_auth("sk-legacy")
            )
            assert legacy.status_code == 200
        assert _sample(running, "iop_edge_key_requests_total", key="only-models") == 1
        assert _sample(running, "iop_edge_key_requests_total", key=legacy_name("sk-legacy")) == 1
        assert _sample(running, "iop_edge_key_tokens_total", key="only-models", type="output") == 2
        assert (
            _sample(running, "iop_edge_key_rejections_total", key="only-models", limit="model") == 1
        )
    finally:
        await stop_edge(running)


async def _partial_request(
    url: str, secret: str, sent: int = 2**16
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A 4 MB request of which only the head and `sent` bytes of body are sent: the
    answer (status, headers, JSON body), read while the rest of the body is still to
    come (the client never sends it). The connection closes after it."""
    host, _, port = url.removeprefix("http://").partition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    conn = h11.Connection(h11.CLIENT)
    length = 4 * 2**20 - 2**10
    head = h11.Request(
        method="POST", target=CHAT,
        headers=[("host", host), ("authorization", f"Bearer {secret}"),
                 ("content-type", "application/json"), ("content-length", str(length))],
    )  # fmt: skip
    body = b'{"model": "sim-echo", "messages": [' + b" " * (sent - 35)
    try:
        await stream.send_all(conn.send(head) + conn.send(h11.Data(data=body)))
        with trio.fail_after(20):
            status, headers, content = await read_response(stream, conn)
            while await stream.receive_some(2**16):  # then the edge closes the connection
                pass
        return status, headers, json.loads(content)
    finally:
        await stream.aclose()


async def test_a_key_over_its_limits_is_answered_before_its_body_is_read(
    keyed: RunningEdge, client: httpx.AsyncClient
) -> None:
    """A key over its rpm, and one at its max_streams, sending 4 MB bodies: the 429
    (Retry-After, rate-limit headers, the same error) comes while all but 64 KiB of
    the body is still unsent, so nothing of it was parsed, and the connection closes;
    another key is served meanwhile."""
    for _ in range(3):
        ok = await client.post(CHAT, json=chat_body("sim-echo", "hi"), headers=_auth("sk-team-a"))
        assert ok.status_code == 200
    status, headers, body = await _partial_request(keyed.url, "sk-team-a")
    assert status == 429
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-remaining-requests"] == "0"
    error = body["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "rate_limit_exceeded")
    assert _sample(keyed, "iop_edge_key_rejections_total", key="team-a", limit="requests") == 1

    held: list[str] = []
    async with trio.open_nursery() as holders:
        for _ in range(2):
            holders.start_soon(_hold, client, held)
        await poll(lambda: len(held) == 2)
        answers: list[tuple[int, dict[str, str], dict[str, Any]]] = []

        async def over_streams() -> None:
            answers.append(await _partial_request(keyed.url, "sk-streams"))

        async with trio.open_nursery() as both:  # the 429 and another key's answer at once
            both.start_soon(over_streams)
            other = await client.post(
                CHAT, json=chat_body("sim-echo", "hi"), headers=_auth("sk-free")
            )
            assert other.status_code == 200
        ((status, headers, body),) = answers
        assert status == 429
        assert headers["retry-after"] == "1"
        assert "in flight" in body["error"]["message"]
        holders.cancel_scope.cancel()
    assert _sample(keyed, "iop_edge_key_rejections_total", key="streams", limit="streams") == 1


async def test_an_early_429_ends_in_a_clean_close_while_the_body_still_comes(
    keyed: RunningEdge, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key over its rpm sends the head and the first 64 KiB of a 4 MB body, then keeps
    sending the rest: it reads the whole 429 and then the end of the connection (EOF),
    never a reset, and the rest of its body goes out. The edge half-closes after the
    answer and reads and drops what still comes of the request (bounded): a close with
    unread bytes is a RST, which on a lossy network destroys an answer not read yet."""
    length = 4 * 2**20 - 2**10
    # The linger's bounds (0.5 s, 1 MiB) raised to the whole body, so that the client
    # sending all of it does not depend on the machine's speed.
    monkeypatch.setattr(connection, "_LINGER_S", 60.0)
    monkeypatch.setattr(connection, "_LINGER_BYTES", 2 * length)
    for _ in range(3):
        ok = await client.post(CHAT, json=chat_body("sim-echo", "hi"), headers=_auth("sk-team-a"))
        assert ok.status_code == 200
    host, _, port = keyed.url.removeprefix("http://").partition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    conn = h11.Connection(h11.CLIENT)
    head = h11.Request(
        method="POST", target=CHAT,
        headers=[("host", host), ("authorization", "Bearer sk-team-a"),
                 ("content-type", "application/json"), ("content-length", str(length))],
    )  # fmt: skip
    first = b'{"model": "sim-echo", "messages": [' + b" " * (2**16 - 35)
    rest = b" " * (length - len(first))
    received = bytearray()
    sent: list[str] = []

    async def send_the_rest() -> None:
        try:
            for start in range(0, len(rest), 2**16):
                await stream.send_all(rest[start : start + 2**16])
            await stream.send_eof()
        except trio.BrokenResourceError as exc:
            sent.append(f"reset: {exc.__cause__!r}")
        else:
            sent.append("all")

    try:
        await stream.send_all(conn.send(head) + conn.send(h11.Data(data=first)))
        with trio.fail_after(20):
            async with trio.open_nursery() as sending:
                sending.start_soon(send_the_rest)
                while data := await stream.receive_some(2**16):  # a reset raises here
                    received += data
    finally:
        await stream.aclose()
    conn.receive_data(bytes(received))
    response = conn.next_event()
    assert isinstance(response, h11.Response)
    assert response.status_code == 429
    content = b""
    while isinstance(event := conn.next_event(), h11.Data):
        content += event.data
    assert isinstance(event, h11.EndOfMessage)  # the whole answer, as its length says
    assert json.loads(content)["error"]["code"] == "rate_limit_exceeded"
    conn.receive_data(b"")  # then the end of the connection
    assert isinstance(conn.next_event(), h11.ConnectionClosed)
    assert sent == ["all"]
