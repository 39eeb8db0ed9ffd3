"""The one cancel path, end to end: disconnects and timeouts cancel the run on the node, once.

Each test drives a real edge over a socket against an `iop-sim-node`
process, then reads the node's runs log: a run the caller abandoned ends
`cancelled` with exactly one CancelRun; a run that completed gets none.
Timeouts are small, but nothing here asserts how long anything took.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
import trio

from edge.config import ServerConfig
from tests.integration.conftest import (
    WEATHER_TOOL,
    RunningEdge,
    SimProcess,
    chat_body,
    edge_config,
    script,
    stalled_stream,
    start_edge,
    stop_edge,
)

CHAT = "/v1/chat/completions"
HANG = {"type": "hang"}


async def _read_frames(response: httpx.Response, count: int) -> list[dict[str, object]]:
    """Read `count` data frames of an SSE response."""
    frames: list[dict[str, object]] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            frames.append(json.loads(line[len("data: ") :]))
            if len(frames) == count:
                break
    return frames


async def _assert_cancelled_once(edge: RunningEdge, sim: SimProcess, run_id: str) -> None:
    run = await sim.wait_run(run_id)
    assert run["outcome"] == "cancelled"
    assert run["cancel_rpcs"] == 1
    await edge.wait_idle()


@pytest.fixture
async def timeout_edge(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[RunningEdge]:
    running = await start_edge(
        nursery, edge_config(sim, first_event_s=0.3, idle_s=0.3, total_s=1.0)
    )
    yield running
    await stop_edge(running)


async def test_disconnect_mid_stream(
    edge: RunningEdge, http: httpx.AsyncClient, sim: SimProcess
) -> None:
    """A client that leaves mid-stream: the run is cancelled on the node exactly once."""
    body = chat_body("sim-script", script({"type": "delta", "delta": "partial"}, HANG), stream=True)
    async with http.stream("POST", CHAT, json=body) as response:
        role, content = await _read_frames(response, 2)
    assert content["choices"][0]["delta"] == {"content": "partial"}  # type: ignore[index]
    run_id = str(role["id"]).removeprefix("chatcmpl-")
    await _assert_cancelled_once(edge, sim, run_id)
    assert edge.outcome(run_id).status == "cancelled"


async def _accepted_run_id(edge: RunningEdge, request_id: str) -> str:
    """The run id of the request's run, once its node accepted it (no byte was sent yet)."""
    with trio.fail_after(10):
        while True:
            for run in edge.edge.runs.live:
                if run.info.request_id == request_id and run.accepted:
                    return run.info.run_id
            await trio.sleep(0.01)  # in-process state with no event of its own


async def test_disconnect_before_first_token(
    edge: RunningEdge, http: httpx.AsyncClient, sim: SimProcess
) -> None:
    """A client that leaves while the model has produced nothing yet (the status is not
    committed, so it got no byte): cancelled once."""
    body = chat_body("sim-script", script(HANG), stream=True)
    async with trio.open_nursery() as nursery:

        async def ask() -> None:
            await http.post(CHAT, json=body, headers={"X-Request-Id": "leaves-early"})

        nursery.start_soon(ask)
        run_id = await _accepted_run_id(edge, "leaves-early")
        nursery.cancel_scope.cancel()  # the client hangs up
    await _assert_cancelled_once(edge, sim, run_id)
    assert (await edge.wait_outcome(run_id)).status == "cancelled"


async def test_disconnect_during_tool_hold_back(
    edge: RunningEdge, http: httpx.AsyncClient, sim: SimProcess
) -> None:
    """A client that leaves while the tool-text filter holds text back: cancelled once."""
    body = chat_body(
        "sim-script",
        script({"type": "delta", "delta": "Checking. "},
               {"type": "delta", "delta": '<tool_call>{"name": "get_weather", '}, HANG),
        stream=True, tools=[WEATHER_TOOL],
    )  # fmt: skip
    async with http.stream("POST", CHAT, json=body) as response:
        role, content = await _read_frames(response, 2)
    # Text before the candidate streams at once (trailing space may wait with the candidate).
    assert content["choices"][0]["delta"]["content"].strip() == "Checking."  # type: ignore[index]
    await _assert_cancelled_once(edge, sim, str(role["id"]).removeprefix("chatcmpl-"))


async def test_disconnect_non_streaming(edge: RunningEdge, sim: SimProcess) -> None:
    """A non-streaming caller that leaves before the answer: the run is cancelled once."""
    async with httpx.AsyncClient(base_url=edge.url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(CHAT, json=chat_body("sim-script", script(HANG)))
    await edge.wait_idle()
    info, outcome = edge.outcomes[-1]
    assert outcome.status == "cancelled"
    await _assert_cancelled_once(edge, sim, info.run_id)


async def test_completed_run_gets_no_cancel(
    edge: RunningEdge, http: httpx.AsyncClient, sim: SimProcess
) -> None:
    """A client that leaves right after the finish chunk, before [DONE]: no CancelRun."""
    body = chat_body(
        "sim-script", script({"type": "delta", "delta": "x"}, {"type": "complete"}), stream=True
    )
    async with http.stream("POST", CHAT, json=body) as response:
        frames = await _read_frames(response, 3)
    assert frames[-1]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
    run = await sim.wait_run(str(frames[0]["id"]).removeprefix("chatcmpl-"))
    assert run["outcome"] == "complete"
    assert run["cancel_rpcs"] == 0
    await edge.wait_idle()


@pytest.mark.parametrize(
    ("events", "waited_for"),
    [
        ([HANG], "the first token"),
        ([{"type": "delta", "delta": "a"}, HANG], "the next token"),
        (
            [{"type": "delta", "delta": "a"}]
            + [{"sleep_ms": 200}, {"type": "delta", "delta": "b"}] * 20,
            "the run to finish",
        ),
    ],
    ids=["first_event", "idle", "total"],
)
async def test_timeouts_send_an_error_frame_and_cancel(
    timeout_edge: RunningEdge, sim: SimProcess, events: list[dict[str, object]], waited_for: str
) -> None:
    """A caller still reading when a timeout fires gets a `timeout` error frame; the run is
    cancelled on the node once; the request is counted as `timeout`. Before the first
    byte (no keep-alive), the status is not committed: a real 504 with the error."""
    rid = f"timeout-{waited_for.replace(' ', '-')}"
    async with httpx.AsyncClient(base_url=timeout_edge.url, timeout=30) as client:
        response = await client.post(
            CHAT, json=chat_body("sim-script", script(*events), stream=True),
            headers={"X-Request-Id": rid},
        )  # fmt: skip
    if waited_for == "the first token":
        assert response.status_code == 504
        error = response.json()["error"]
    else:
        assert response.status_code == 200
        frames = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: ")]  # fmt: skip
        assert "[DONE]" not in response.text
        error = frames[-1]["error"]
    assert error["type"] == "timeout"
    assert error["message"] == f"timed out waiting for {waited_for}"
    (run_id,) = [info.run_id for info, _ in timeout_edge.outcomes if info.request_id == rid]
    await _assert_cancelled_once(timeout_edge, sim, run_id)
    assert timeout_edge.outcome(run_id).status == "timeout"


async def test_non_streaming_timeout_is_504(timeout_edge: RunningEdge, sim: SimProcess) -> None:
    """A non-streaming run that times out answers 504 with a `timeout` error."""
    async with httpx.AsyncClient(base_url=timeout_edge.url, timeout=30) as client:
        response = await client.post(CHAT, json=chat_body("sim-script", script(HANG)))
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout"
    await timeout_edge.wait_idle()


async def test_keepalive_comments_while_waiting_for_the_first_token(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """While the first token is slow, the stream carries SSE comments, then the answer."""
    config = replace(edge_config(sim), server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0.05))
    running = await start_edge(nursery, config)
    body = chat_body(
        "sim-script",
        # 1.5 s against 0.05 s: keep-alives are due many times over, however loaded the machine.
        script({"sleep_ms": 1500}, {"type": "delta", "delta": "late"}, {"type": "complete"}),
        stream=True,
    )
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
        response = await client.post(CHAT, json=body)
    text = response.text
    assert ": keep-alive\n\n" in text
    assert text.index(": keep-alive") < text.index('"content":"late"')
    assert text.endswith("data: [DONE]\n\n")
    await stop_edge(running)


async def test_edge_serves_on_after_many_disconnects(
    edge: RunningEdge, http: httpx.AsyncClient, sim: SimProcess
) -> None:
    """Twenty abandoned streams leave no run task behind, and the next request is served."""
    body = chat_body("sim-script", script({"type": "delta", "delta": "x"}, HANG), stream=True)
    run_ids = []
    for _ in range(20):
        async with http.stream("POST", CHAT, json=body) as response:
            role, _content = await _read_frames(response, 2)
        run_ids.append(str(role["id"]).removeprefix("chatcmpl-"))
    for run_id in run_ids:
        await _assert_cancelled_once(edge, sim, run_id)
    response = await http.post(CHAT, json=chat_body("sim-echo", "still here"))
    assert response.json()["choices"][0]["message"]["content"] == "still here"


async def test_client_that_stops_reading_is_treated_as_gone(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """A client that keeps its socket open but stops reading: once output has waited
    `slow_client_s`, the run is cancelled on the node (once), whatever the socket does."""
    running = await start_edge(nursery, edge_config(sim, slow_client_s=0.5))
    big = "x" * 4096
    body = chat_body(
        "sim-script", script({"type": "delta", "delta": big, "repeat": 20_000}), stream=True
    )
    async with stalled_stream(running.url, body) as (head, run_id, _):
        assert head.startswith(b"HTTP/1.1 200")
        run = await sim.wait_run(run_id, within_s=30)
        assert run["outcome"] == "cancelled"
        assert run["cancel_rpcs"] == 1
        assert run["events_sent"] < 20_000
    assert (await running.wait_outcome(run_id)).status == "cancelled"
    await running.wait_idle()
    await stop_edge(running)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_node_that_does_not_accept_the_run_is_a_504(
    timeout_edge: RunningEdge, sim: SimProcess, stream: bool
) -> None:
    """A node that has not accepted a run within first_event_s: 504 `timeout` before any
    byte (streaming or not), and the run is cancelled on the node once."""
    body = chat_body("sim-script", script({"accept_after_ms": 5000}, HANG), stream=stream)
    async with httpx.AsyncClient(base_url=timeout_edge.url, timeout=30) as client:
        response = await client.post(CHAT, json=body)
    assert response.status_code == 504
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["type"] == "timeout"
    info, outcome = timeout_edge.outcomes[-1]
    assert outcome.error_type == "timeout"
    await _assert_cancelled_once(timeout_edge, sim, info.run_id)
    assert (await sim.wait_run(info.run_id))["events_sent"] == 0
