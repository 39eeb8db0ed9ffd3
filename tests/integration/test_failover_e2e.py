"""Failover before the first byte, the status committed at the first byte, over real nodes.

Two or three `iop-sim-node` processes behind a real edge. A sim-script item
with `"on_node": NAME` plays only on the node of that name, so one script
fails on one node and answers on the other.

- A node that refuses (its process gone), an error event before any output,
  an accept that never comes: the request is answered by the other node,
  under the one run id; the retry is counted; the runs logs show the run was
  never live on both nodes (the first ended before the second began).
- A run that fails after the accept but before the first byte, on every node
  tried, is a real 502/504 with an OpenAI error body, counted once.
- One node killed under load: every request that had not received a byte
  succeeds; streams mid-answer on the dead node end with an error frame.

Waits are bounded polls on in-process state or on the nodes' runs logs;
nothing asserts a duration.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.config import Config, NodeConfig, RoutingConfig, ServerConfig, TimeoutsConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    kill_process,
    named_sims,
    poll,
    script,
    sse_content,
    sse_frames,
    start_edge,
    stop_edge,
    stop_process,
)

CHAT = "/v1/chat/completions"
HANG = {"type": "hang"}
WAIT_S = 20.0


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[tuple[SimProcess, SimProcess]]:
    """Nodes "a" and "b" (fresh for each test: some tests kill one)."""
    with named_sims(tmp_path, "a", "b") as (a, b):
        yield a, b


def _config(*nodes: SimProcess, **timeouts: float) -> Config:
    return Config(
        # No refresh during a test: the edge learns of a dead node from its runs.
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0, node_refresh_s=600),
        timeouts=replace(TimeoutsConfig(), **timeouts),
        # Migration off: these are failover's cases (a break after output ends with an
        # error frame, a non-streaming answer restarts); test_migration_e2e.py moves them.
        routing=RoutingConfig(retries=2, retry_backoff_s=0.01, migrations=0),
        nodes=tuple(NodeConfig(name, n.address) for name, n in zip("ab", nodes, strict=False)),
    )


@pytest.fixture
async def fleet(
    nursery: trio.Nursery, sims: tuple[SimProcess, SimProcess]
) -> AsyncIterator[RunningEdge]:
    running = await start_edge(nursery, _config(*sims, first_event_s=1.0))
    yield running
    await stop_edge(running)


def _counter(edge: RunningEdge, name: str, **labels: str) -> float:
    value = edge.edge.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def _answer(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, str]:
    """The answer's run id and content, streamed or not; asserts a 200 success."""
    response = await http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    if body.get("stream"):
        assert response.text.endswith("data: [DONE]\n\n"), response.text[-300:]
        frames = sse_frames(response.text)
        return frames[0]["id"].removeprefix("chatcmpl-"), sse_content(frames)
    data = response.json()
    return data["id"].removeprefix("chatcmpl-"), data["choices"][0]["message"]["content"]


def _never_live_on_both(first: dict[str, Any], second: dict[str, Any]) -> None:
    """The runs-log lines of one run id on two nodes: the first ended before the second."""
    assert first["ended_at"] is not None
    assert first["ended_at"] <= second["started_at"], (first, second)


# --- failover before the first byte ---------------------------------------------------------


async def test_a_node_that_refuses_is_failed_over(
    nursery: trio.Nursery, sims: tuple[SimProcess, SimProcess]
) -> None:
    """Node a's process is gone while the edge still routes to it: streamed and non-streamed
    requests all succeed on b; the refusal is counted as a retry from a, and every request
    is counted once, as a success on b."""
    a, b = sims
    running = await start_edge(nursery, _config(a, b))
    stop_process(a.process)  # the edge learns it from the next run it sends there
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        for stream in (False, True, False, True):
            _, content = await _answer(http, chat_body("sim-echo", "hello there", stream=stream))
            assert content == "hello there"
    assert _counter(running, "iop_edge_retries_total", node="a", reason="unavailable") == 1
    assert running.requests() == {
        ("sim-echo", "b", "false", "success"): 2,
        ("sim-echo", "b", "true", "success"): 2,
    }
    await stop_edge(running)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
async def test_an_error_event_before_output_is_failed_over(
    fleet: RunningEdge, sims: tuple[SimProcess, SimProcess], stream: bool
) -> None:
    """A node whose run fails before any output (an error event, or a stream that breaks):
    the answer comes from the other node, with the one response id; node a's runs log has
    the run failed and ended before node b's began. Every request counted once."""
    a, b = sims
    scripts = [
        script({"on_node": "a", "type": "error", "error": "boom"},
               {"type": "delta", "delta": "ok"}, {"type": "complete"}),
        script({"on_node": "a", "type": "abort"},
               {"type": "delta", "delta": "ok"}, {"type": "complete"}),
    ]  # fmt: skip
    run_ids = []
    async with httpx.AsyncClient(base_url=fleet.url, timeout=30) as http:
        # Enough requests that some go to node a first, whatever the pool's tie-break.
        for i in range(6):
            run_id, content = await _answer(
                http, chat_body("sim-script", scripts[i % 2], stream=stream)
            )
            assert content == "ok"
            run_ids.append(run_id)
    await fleet.wait_idle()
    tried_a = 0
    for run_id in run_ids:
        on_b = await b.wait_run(run_id)
        assert on_b["outcome"] == "complete"
        on_a = a.run(run_id)
        if on_a is not None:
            tried_a += 1
            assert on_a["outcome"] in ("error", "aborted")
            _never_live_on_both(on_a, on_b)
    assert tried_a >= 1
    retries = _counter(fleet, "iop_edge_retries_total", node="a", reason="error_event") + _counter(
        fleet, "iop_edge_retries_total", node="a", reason="stream_broken"
    )
    assert retries == tried_a
    labels = ("sim-script", "b", "true" if stream else "false", "success")
    assert fleet.requests() == {labels: 6}


async def test_an_accept_that_never_comes_is_cancelled_then_failed_over(
    fleet: RunningEdge, sims: tuple[SimProcess, SimProcess]
) -> None:
    """Node a holds its accept past first_event_s: the edge sends it CancelRun, and only
    once that is done starts the run on b (a's run ended before b's began)."""
    a, b = sims
    body = chat_body(
        "sim-script",
        script({"on_node": "a", "accept_after_ms": 10_000}, {"type": "delta", "delta": "ok"},
               {"type": "complete"}),
        stream=True,
    )  # fmt: skip
    tried_a = 0
    async with httpx.AsyncClient(base_url=fleet.url, timeout=30) as http:
        for _ in range(4):
            run_id, content = await _answer(http, body)
            assert content == "ok"
            on_b = await b.wait_run(run_id)
            # CancelRun is answered once the run is over on a: its line is written by then.
            on_a = a.run(run_id)
            if on_a is not None:
                tried_a += 1
                assert (on_a["outcome"], on_a["cancel_rpc"]) == ("cancelled", True)
                _never_live_on_both(on_a, on_b)
    assert tried_a >= 1
    assert _counter(fleet, "iop_edge_retries_total", node="a", reason="accept_timeout") == tried_a
    await fleet.wait_idle()


# --- the status is committed at the first byte ----------------------------------------------


@pytest.mark.parametrize(
    ("events", "status", "error_type"),
    [
        ([{"type": "error", "error": "boom"}], 502, "run_error"),
        ([{"type": "abort"}], 502, "run_error"),
        ([HANG], 504, "timeout"),
    ],
    ids=["error event", "stream breaks", "first-event timeout"],
)
async def test_a_failure_before_the_first_byte_is_a_real_status(
    nursery: trio.Nursery,
    sims: tuple[SimProcess, SimProcess],
    events: list[dict[str, Any]],
    status: int,
    error_type: str,
) -> None:
    """A streamed run that fails after the node accepted it but before any output, on
    every node tried, is answered with a real status and an OpenAI error body, not 200
    and an error frame; the request is counted once."""
    a, b = sims
    running = await start_edge(nursery, _config(a, b, first_event_s=0.3))
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        response = await http.post(CHAT, json=chat_body("sim-script", script(*events),
                                                        stream=True))  # fmt: skip
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["type"] == error_type
    assert error["message"]
    await running.wait_idle()
    counted = running.requests()
    assert sum(counted.values()) == 1
    ((model, _node, streamed, outcome),) = counted
    assert (model, streamed) == ("sim-script", "true")
    assert outcome == ("timeout" if status == 504 else "error")
    await stop_edge(running)


# --- a node killed under load ---------------------------------------------------------------


async def test_a_node_killed_under_load(
    nursery: trio.Nursery, sims: tuple[SimProcess, SimProcess]
) -> None:
    """100 streamed requests sent across the kill of node a: those waiting for their
    first byte on a (a holds them before any output) and those sent after the kill all
    succeed on b. Streams mid-answer on a end with an error frame, never silently. No run
    id is live on two nodes."""
    a, b = sims
    running = await start_edge(nursery, _config(a, b))
    # On a: held before any output; on b: answered after a moment.
    waiting = chat_body(
        "sim-script",
        script({"on_node": "a", "type": "hang"}, {"on_node": "b", "sleep_ms": 200},
               {"type": "delta", "delta": "done"}, {"type": "complete"}),
        stream=True,
    )  # fmt: skip
    midway = chat_body("sim-script", script({"type": "delta", "delta": "x"}, HANG), stream=True)
    answers: list[httpx.Response] = []
    mid_texts: list[str] = []

    async def ask(http: httpx.AsyncClient, i: int) -> None:
        answers.append(await http.post(CHAT, json=waiting, headers={"X-Request-Id": f"ask-{i}"}))

    async def mid(http: httpx.AsyncClient, i: int, started: trio.Event) -> None:
        headers = {"X-Request-Id": f"mid-{i}"}
        async with http.stream("POST", CHAT, json=midway, headers=headers) as response:
            text = ""
            async for chunk in response.aiter_text():
                text += chunk
                if '"content":"x"' in text:
                    started.set()
            mid_texts.append(text)

    def live_on_a(prefix: str) -> int:
        return sum(
            1 for r in running.edge.runs.live
            if r.info.node == "a" and r.accepted and r.info.request_id.startswith(prefix)
        )  # fmt: skip

    limits = httpx.Limits(max_connections=200)
    async with (
        httpx.AsyncClient(base_url=running.url, timeout=60, limits=limits) as http,
        trio.open_nursery() as mids,
    ):
        for i in range(6):
            started = trio.Event()
            mids.start_soon(mid, http, i, started)
            await started.wait()
        async with trio.open_nursery() as asks:
            for i in range(50):
                asks.start_soon(ask, http, i)
            await poll(lambda: live_on_a("ask-") >= 5)
            mids_on_a = live_on_a("mid-")
            kill_process(a.process)
            for i in range(50, 100):
                asks.start_soon(ask, http, i)
        # The streams mid-answer on a have ended; those on b still run: they go.
        await poll(lambda: len(mid_texts) == mids_on_a)
        mids.cancel_scope.cancel()
    assert len(answers) == 100
    for response in answers:
        assert response.status_code == 200, response.text
        assert response.text.endswith("data: [DONE]\n\n")
        assert sse_content(sse_frames(response.text)) == "done"
    assert mids_on_a >= 1
    for text in mid_texts:
        assert "data: [DONE]" not in text
        last = sse_frames(text)[-1]
        assert last["error"]["type"] == "run_error", text[-300:]
    await running.wait_idle(within_s=30)
    # b ran each run id at most once; a (killed) logged only runs it had ended.
    on_b = [r for r in b.runs() if "outcome" in r]
    assert len(on_b) == len({r["run_id"] for r in on_b})
    ended_on_a = {r["run_id"]: r for r in a.runs() if "outcome" in r}
    for record in on_b:
        if record["run_id"] in ended_on_a:
            _never_live_on_both(ended_on_a[record["run_id"]], record)
    await stop_edge(running)


# --- the pool's verdicts and affinity, driven by real requests ---------------------------


async def test_the_same_session_lands_on_the_same_node(
    nursery: trio.Nursery, sims: tuple[SimProcess, SimProcess]
) -> None:
    """policy = "affinity": every request of a session (its X-Session-Id, its
    `prompt_cache_key`, else its `user`) is answered by one node; the sessions spread over
    both nodes."""
    config = _config(*sims)
    config = replace(config, routing=replace(config.routing, policy="affinity"))
    running = await start_edge(nursery, config)
    sessions = [f"session-{i}" for i in range(20)]
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        for _ in range(3):
            for session in sessions:
                header = await http.post(
                    CHAT, json=chat_body("sim-echo", "hi"), headers={"X-Session-Id": session}
                )
                by_user = await http.post(CHAT, json=chat_body("sim-echo", "hi", user=session))
                by_key = await http.post(
                    CHAT, json=chat_body("sim-echo", "hi", prompt_cache_key=session)
                )
                statuses = (header.status_code, by_user.status_code, by_key.status_code)
                assert statuses == (200, 200, 200)
    await stop_edge(running)
    nodes: dict[str, set[str]] = {}
    for (info, _), session in zip(running.outcomes, [s for _ in range(3) for s in sessions
                                                     for _ in range(3)], strict=True):  # fmt: skip
        nodes.setdefault(session, set()).add(info.node)
    assert all(len(served) == 1 for served in nodes.values()), nodes
    assert {node for served in nodes.values() for node in served} == {"a", "b"}


async def test_failed_runs_open_the_breaker_and_the_next_request_gets_503(
    nursery: trio.Nursery, sims: tuple[SimProcess, SimProcess]
) -> None:
    """A node whose runs fail before any output (no other node to fail over to): each is a
    502; after breaker_failures of them the breaker is open, /readyz says so, and the next
    request is a 503 node_unavailable with no run sent."""
    a, _ = sims
    config = _config(a)
    config = replace(
        config, routing=replace(config.routing, breaker_failures=3, breaker_cooldown_s=600)
    )
    running = await start_edge(nursery, config)
    fail = script({"type": "error", "error": "the model fell over"})
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        for _ in range(3):
            failed = await http.post(CHAT, json=chat_body("sim-script", fail))
            assert failed.status_code == 502, failed.text
        refused = await http.post(CHAT, json=chat_body("sim-echo", "hi"))
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "node_unavailable"
        nodes = (await http.get("/readyz")).json()["nodes"]
        assert [n["state"] for n in nodes] == ["open"]
    await stop_edge(running)
    assert len(a.runs()) == 3


async def test_a_non_streaming_answer_whose_node_fails_after_output_is_failed_over(
    fleet: RunningEdge, sims: tuple[SimProcess, SimProcess]
) -> None:
    """Not streamed, no byte reaches the client before the answer is whole: a run that
    failed after some output is tried again on the other node, from the start."""
    a, b = sims
    fails_on_a = script(
        {"type": "delta", "delta": "par"}, {"on_node": "a", "type": "error", "error": "boom"},
        {"on_node": "b", "type": "delta", "delta": "tial"}, {"type": "complete"},
    )  # fmt: skip
    run_ids = []
    async with httpx.AsyncClient(base_url=fleet.url, timeout=30) as http:
        for _ in range(6):
            answer = await http.post(CHAT, json=chat_body("sim-script", fails_on_a))
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == "partial"
            run_ids.append(answer.json()["id"].removeprefix("chatcmpl-"))
    await fleet.wait_idle()
    tried_a = sum(a.run(run_id) is not None for run_id in run_ids)
    assert tried_a > 0
    for run_id in run_ids:
        assert (await b.wait_run(run_id))["outcome"] == "complete"
