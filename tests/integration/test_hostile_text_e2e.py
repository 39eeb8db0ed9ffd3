"""End to end: an answer written to make the tool-text scans work hard holds no loop.

A model can be prompted to write megabytes of text that looks like the start of
tool-call markup (lines of `{`, open strings, fences, tags). Here a real
`iop-sim-node` writes a 4 MiB answer of such text in 1 MiB deltas, with one tool
declared, through a real edge: the answer is the text itself (no call), streamed
or not, and `/healthz` keeps answering while it is processed. The longest
time between two `/healthz` answers is printed (run with `-s`); the test bounds it only
generously, never asserts wall-clock times.

A node may also send one huge delta: 3.8 MB of `<` in one event. The edge
(in this process) applies it a slice a step, so `/healthz`, asked back to back,
is answered while the delta is still being applied, and the answer is the
whole delta.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from tests.integration.conftest import WEATHER_TOOL, RunningEdge, chat_body, script
from tests.integration.test_chat_e2e import parse_sse

CHAT = "/v1/chat/completions"
MiB = 1024 * 1024
DELTAS = 4
# Generous: each answer takes well under a second; a frozen loop took tens of seconds.
BOUND_S = 60
HEALTHZ_BOUND_S = 5


def hostile(line: str) -> tuple[str, str]:
    """A script writing DELTAS deltas of 1 MiB of `line` repeated, and the whole text."""
    times = MiB // len(line)
    item = {"type": "delta", "delta": line, "delta_times": times, "repeat": DELTAS}
    done = {"type": "complete", "metadata": {"finish_reason": "stop"}}
    return script(item, done), line * times * DELTAS


async def healthz_while(http: httpx.AsyncClient, done: trio.Event, gaps: list[float]) -> None:
    """Ask /healthz every 5 ms until `done`, keeping the time between answers (a held
    loop shows whether it held the request or the pause); each within the bound."""
    while not done.is_set():
        start = trio.current_time()
        with trio.fail_after(HEALTHZ_BOUND_S):
            await trio.sleep(0.005)
            assert (await http.get("/healthz")).status_code == 200
        gaps.append(trio.current_time() - start)


async def answer_with_healthz(http: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    """Post `body` while /healthz is polled; print the slowest /healthz answer."""
    done = trio.Event()
    gaps: list[float] = []
    responses: list[httpx.Response] = []

    async def post() -> None:
        try:
            responses.append(await http.post(CHAT, json=body))
        finally:
            done.set()

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(healthz_while, http, done, gaps)
            nursery.start_soon(post)
    print(
        f"\n/healthz during a {DELTAS} MiB hostile answer: {len(gaps)} answers, longest"
        f" time between two (5 ms pause included) {max(gaps, default=0.0) * 1000:.1f} ms"
    )
    return responses[0]


async def test_four_mib_of_brace_lines_with_a_tool_is_answered_not_streamed(
    http: httpx.AsyncClient,
) -> None:
    """4 MiB of `{` lines, one tool declared, not streamed: a 200 whose content is the
    text and whose finish_reason is stop."""
    events, text = hostile("{\n")
    body = chat_body("sim-script", events, tools=[WEATHER_TOOL])
    response = await answer_with_healthz(http, body)
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text
    assert not choice["message"].get("tool_calls")


async def stream_content(http: httpx.AsyncClient, events: str) -> tuple[str, dict[str, Any]]:
    body = chat_body("sim-script", events, tools=[WEATHER_TOOL], stream=True)
    response = await answer_with_healthz(http, body)
    assert response.status_code == 200
    payloads = parse_sse(response.content)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return content, chunks[-1]["choices"][0]


async def test_four_mib_of_brace_lines_with_a_tool_is_streamed(http: httpx.AsyncClient) -> None:
    """The same answer streamed: all of it arrives as content, then the terminal frame."""
    events, text = hostile("{\n")
    content, last = await stream_content(http, events)
    assert content == text
    assert last["finish_reason"] == "stop"


async def test_other_hostile_alphabets_are_streamed_whole(http: httpx.AsyncClient) -> None:
    """Open strings, fences and tag prefixes: the same, a normal streamed answer."""
    for line in ('{"\n', "```\n", "<tool_cal"):
        events, text = hostile(line)
        content, last = await stream_content(http, events)
        assert content == text, line
        assert last["finish_reason"] == "stop"


BIG_DELTA_CHARS = 3_800_000


@pytest.mark.parametrize("stream", [True, False])
async def test_one_big_delta_of_lt_is_applied_while_healthz_is_answered(
    edge: RunningEdge, http: httpx.AsyncClient, stream: bool
) -> None:
    """One 3.8 MB delta of `<` (every character may start a sentinel) from the node:
    `/healthz`, asked back to back, is answered while the edge is still applying the delta
    (a run's session is between two slices of it), each answer within the generous bound,
    and the answer is the whole delta, streamed in many chunks (or whole, not streamed)."""
    text = "<" * BIG_DELTA_CHARS
    item = {"type": "delta", "delta": "<", "delta_times": BIG_DELTA_CHARS}
    done_item = {"type": "complete", "metadata": {"finish_reason": "stop"}}
    body = chat_body("sim-script", script(item, done_item), stream=stream)
    done = trio.Event()
    answers = mid_delta = 0
    responses: list[httpx.Response] = []

    async def probe() -> None:
        nonlocal answers, mid_delta
        while not done.is_set():
            with trio.fail_after(HEALTHZ_BOUND_S):
                assert (await http.get("/healthz")).status_code == 200
            answers += 1
            if any(run.session.resuming for run in edge.edge.runs.live):
                mid_delta += 1

    async def post() -> None:
        try:
            responses.append(await http.post(CHAT, json=body))
        finally:
            done.set()

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe)
            nursery.start_soon(post)
    print(f"\n/healthz answers: {answers}, {mid_delta} of them between two slices of the delta")
    assert mid_delta >= 1
    response = responses[0]
    assert response.status_code == 200
    if stream:
        payloads = parse_sse(response.content)
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p)["choices"][0] for p in payloads[:-1]]
        pieces = [c["delta"].get("content") or "" for c in chunks]
        assert "".join(pieces) == text
        assert sum(1 for piece in pieces if piece) > 10
        assert chunks[-1]["finish_reason"] == "stop"
    else:
        choice = response.json()["choices"][0]
        assert choice["message"]["content"] == text
        assert choice["finish_reason"] == "stop"
