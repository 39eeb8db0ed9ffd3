"""End to end: the simulated node (a real process) continues an answer another run started.

Runs go over real gRPC with the edge's node client (`GrpcNodeClient.start_run`),
without an edge: a run is read for k events and cancelled, as a node that died
mid-answer leaves it, and its continuation is started directly with a RunRequest
whose `continuation` holds what was read. The sim is deterministic, so the
continuation's events must be exactly the uncut run's from the cut on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from edge.contract._proto.iop.node import v1 as pb
from edge.node.bridge import asyncio_loop
from edge.node.client import EndCause, GrpcNodeClient, NodeSocket
from edge.stream.events import (
    Complete,
    Delta,
    Failed,
    LogprobDelta,
    NodeEvent,
    ReasoningDelta,
)
from tests.integration.conftest import (
    SimProcess,
    describe_through_stub,
    node_events,
    script,
    start_sim,
    stop_process,
)

WAIT_S = 10.0

# An answer of reasoning then text, with a sleep among its events (skipped before the
# cut, played after it) and its own usage.
ANSWER = script(
    *[{"type": "reasoning_delta", "delta": f"step {i}. "} for i in range(4)],
    {"sleep_ms": 5},
    *[{"type": "delta", "delta": f"word{i} "} for i in range(12)],
    {"type": "delta", "delta": "end", "repeat": 3},
    {
        "type": "complete",
        "usage": {"input_tokens": 7, "output_tokens": 19},
        "metadata": {"finish_reason": "stop"},
    },
)


def _request(run_id: str, content: str, model: str = "sim-script", **fields: Any) -> pb.RunRequest:
    return pb.RunRequest(
        run_id=run_id, model=model, messages=[pb.Message(role="user", content=content)], **fields
    )


def _client(node: SimProcess) -> GrpcNodeClient:
    host, port = node.address.rsplit(":", 1)
    return GrpcNodeClient("sim", NodeSocket.tcp(host, int(port)))


async def _whole(node: SimProcess, request: pb.RunRequest) -> list[NodeEvent]:
    """Every event of `request`, to its end."""
    client = _client(node)
    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(WAIT_S):
                handle = await client.start_run(
                    nursery, request, deadline=trio.current_time() + WAIT_S, accept_s=WAIT_S
                )
                return await node_events(handle)
    finally:
        await client.aclose()


async def _first(node: SimProcess, request: pb.RunRequest, k: int) -> list[NodeEvent]:
    """The first `k` events of `request`; then the run is cancelled (CancelRun)."""
    client = _client(node)
    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(WAIT_S):
                handle = await client.start_run(
                    nursery, request, deadline=trio.current_time() + WAIT_S
                )
                events = [await handle.events.receive() for _ in range(k)]
                handle.cancel(EndCause.CLIENT_GONE)
                await handle.done.wait()
        return events
    finally:
        await client.aclose()


def _held(events: list[NodeEvent]) -> pb.Continuation:
    """What an edge that received `events` sends a continuation: their texts, by kind."""
    return pb.Continuation(
        text="".join(e.text for e in events if isinstance(e, Delta)),
        reasoning="".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        output_tokens=len(events),
    )


@pytest.mark.parametrize("k", [1, 4, 9, 17])
async def test_a_cut_run_continues_with_exactly_the_rest(sim: SimProcess, k: int) -> None:
    """A run read for k events and cancelled, then continued from their text and
    reasoning on the same node: the continuation sends exactly the uncut run's events
    after the first k (its terminal and usage included), and nothing before them."""
    async with asyncio_loop():
        uncut = await _whole(sim, _request(f"cont-uncut-{k}", ANSWER))
        read = await _first(sim, _request(f"cont-first-{k}", ANSWER), k)
        assert read == uncut[:k]
        rest = await _whole(sim, _request(f"cont-rest-{k}", ANSWER, continuation=_held(read)))
    assert rest == uncut[k:]
    assert isinstance(rest[-1], Complete)
    assert rest[-1].usage is not None
    assert rest[-1].usage.output_tokens == 19  # the whole answer's, as the script says
    record = await sim.wait_run(f"cont-rest-{k}")
    assert (record["outcome"], record["events_sent"]) == ("complete", len(uncut) - k)


async def test_a_continuation_ending_inside_an_event_sends_it_from_there(sim: SimProcess) -> None:
    """A continuation that ends inside a delta (the earlier node sent its text in other
    pieces): that delta is sent from where it ends, then the rest, so the text read
    plus the continued text is the uncut answer's."""
    async with asyncio_loop():
        uncut = await _whole(sim, _request("cont-inside-uncut", ANSWER))
        text = "".join(e.text for e in uncut if isinstance(e, Delta))
        reasoning = "".join(e.text for e in uncut if isinstance(e, ReasoningDelta))
        held = pb.Continuation(text=text[:10], reasoning=reasoning)
        rest = await _whole(sim, _request("cont-inside", ANSWER, continuation=held))
    assert rest[0] == Delta(text[10 : len("word0 word1 ")])
    assert text[:10] + "".join(e.text for e in rest if isinstance(e, Delta)) == text
    assert not any(isinstance(e, ReasoningDelta) for e in rest)
    assert rest[1:] == uncut[-len(rest) + 1 :]


async def test_sim_echo_continues_with_its_logprobs(sim: SimProcess) -> None:
    """sim-echo with logprobs, continued inside a word: that word's rest with its token,
    then the other words, each with its own."""
    request = _request("cont-echo", "alpha beta gamma", model="sim-echo")
    request.extra_json = json.dumps({"logprobs": True, "top_logprobs": 1})
    request.continuation = pb.Continuation(text="alpha be")
    async with asyncio_loop():
        rest = await _whole(sim, request)
    deltas = [e for e in rest if isinstance(e, LogprobDelta)]
    assert [(e.text, [t.token for t in e.logprobs]) for e in deltas] == [
        ("ta", [" beta"]),
        (" gamma", [" gamma"]),
    ]
    assert isinstance(rest[-1], Complete)


async def test_a_mismatched_continuation_is_an_error_event(sim: SimProcess) -> None:
    """A continuation that is not this answer's start (another request's, garbage) gets
    one error event with no status (the node's failure), never a wrong answer."""
    held = pb.Continuation(text="garbage that no script says", reasoning="")
    async with asyncio_loop():
        events = await _whole(sim, _request("cont-garbage", ANSWER, continuation=held))
    (event,) = events
    assert isinstance(event, Failed)
    assert (event.kind, event.http_status) == ("error", 0)
    assert "not this answer's start" in event.error
    record = await sim.wait_run("cont-garbage")
    assert record["outcome"] == "error"


async def test_describe_says_every_model_continues(sim: SimProcess) -> None:
    """Describe (and so Watch) says `continuation` for each model of the simulated node."""
    response = await describe_through_stub(sim.address)
    assert [(m.id, m.continuation) for m in response.models] == [
        ("sim-echo", True),
        ("sim-script", True),
    ]


async def test_a_node_without_continuation_says_so_and_refuses_one(tmp_path: Path) -> None:
    """`--no-continuation`: Describe says no for each model, and a run that continues
    an answer anyway is an error event, not the answer played again."""
    node = start_sim(tmp_path, "nocont", "--no-continuation")
    try:
        response = await describe_through_stub(node.address)
        assert [m.continuation for m in response.models] == [False, False]
        held = pb.Continuation(text="word0 ")
        async with asyncio_loop():
            events = await _whole(node, _request("nocont-1", ANSWER, continuation=held))
    finally:
        stop_process(node.process)
    (event,) = events
    assert isinstance(event, Failed)
    assert "does not continue answers" in event.error


async def test_continuation_with_the_cache_model_and_decode_pace(tmp_path: Path) -> None:
    """With the KV cache model and a decode pace on: a continuation is accepted at once
    (the script's accept_after_ms is not played again), its prompt counts the text it
    holds (input_tokens), and it sends exactly the rest, at the pace."""
    node = start_sim(
        tmp_path, "kv", "--kv-tokens", "65536", "--prefill-us-per-token", "1",
        "--decode-tokens-per-s", "2000",
    )  # fmt: skip
    answer = script(
        {"accept_after_ms": 600_000, "on_node": "never"},  # only so the item is checked
        *[{"type": "delta", "delta": f"token{i:02d}"} for i in range(10)],
        {"type": "complete", "metadata": {"finish_reason": "stop"}},
    )
    slow_accept = script(
        {"accept_after_ms": 600_000},
        *[{"type": "delta", "delta": f"token{i:02d}"} for i in range(10)],
        {"type": "complete", "metadata": {"finish_reason": "stop"}},
    )
    try:
        async with asyncio_loop():
            uncut = await _whole(node, _request("kv-uncut", answer, prompt_chars=400))
            held = pb.Continuation(text="token00token01token0")  # 20 characters
            rest = await _whole(
                node, _request("kv-rest", slow_accept, prompt_chars=400, continuation=held)
            )
    finally:
        stop_process(node.process)
    assert rest[:-1] == [Delta("2"), *uncut[3:-1]]
    last = rest[-1]
    assert isinstance(last, Complete)
    assert last.usage is not None
    assert last.usage.input_tokens == (400 + 20) // 4
