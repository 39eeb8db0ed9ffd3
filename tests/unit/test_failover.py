"""A run's node slot comes back whatever fails while the run starts.

The fleet in process: a real `NodePool`, `Admission`, `Runs`, `Failover` and
`Answer`, over node clients whose start the tests script (in-process fakes of
the node side only). Each case fails one step of an answer's start, through a
seam the fleet takes from its caller (the session factory, the answer, the
serialized RunRequest, the node client) or by cancelling the caller there; after
the request's answer is over every node's `in_flight` is 0. The steps a real node
can fail (refused, no accept, an error event, a broken stream) are in
tests/integration/test_hostile_runstart_e2e.py.

The same fakes play a node that refuses the request (a 4xx error event) or is
overloaded (a 429): which node answers, and what the breakers make of it.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import pytest
import trio
import trio.testing

from edge.api.request import parse_chat_request
from edge.config import AdmissionConfig, RoutingConfig, TimeoutsConfig
from edge.errors import NodeFailedError
from edge.fleet.admission import Admission
from edge.fleet.answer import Answer
from edge.fleet.failover import Failover
from edge.fleet.pool import NodePool
from edge.fleet.run import Run
from edge.fleet.runs import Runs
from edge.node.bridge import EventBuffer
from edge.node.client import NodeDescription, RunHandle
from edge.node.wire import EncodedRunRequest, PreparedRunRequest
from edge.observe.metrics import EdgeMetrics
from edge.stream.events import Complete, Delta, Failed, NodeEvent
from edge.stream.output import ErrorOut
from edge.stream.session import SessionSettings, StreamSession
from tests.unit.runkit import ScriptedClient, Start

REQUEST = parse_chat_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')


class Boom(Exception):
    """The failure a case injects."""


async def _refused(nursery: trio.Nursery, request: EncodedRunRequest) -> RunHandle:
    raise NodeFailedError("the node refused the run")


async def _bug(nursery: trio.Nursery, request: EncodedRunRequest) -> RunHandle:
    raise Boom("a bug in the node client")


async def _no_accept(nursery: trio.Nursery, request: EncodedRunRequest) -> RunHandle:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


async def _silent(nursery: trio.Nursery, request: EncodedRunRequest) -> RunHandle:
    """Accepted; no event ever comes."""
    return RunHandle(request.run_id, "n", EventBuffer(max_events=16, max_chars=1 << 20))


class _Payload(PreparedRunRequest):
    """The request's RunRequest, whose bytes for an attempt cannot be made."""

    def attempt(self, deadline_unix_ms: int) -> EncodedRunRequest:
        raise Boom("the attempt's bytes")


class _Answer(Answer):
    """The request's answer, failing before it enters the run it is handed."""

    async def hold(self, run: Run) -> None:
        raise Boom("before the run is entered")


def _session() -> StreamSession:
    return StreamSession(SessionSettings(run_id="r1"))


def _no_session() -> StreamSession:
    raise Boom("the session")


# case: (the nodes' starts, payload, scope, session factory, what the caller sees;
# "cancel": the caller leaves once everything waits)
_CASES: dict[str, tuple[tuple[Start, ...], type[PreparedRunRequest], type[Answer],
                        Callable[[], StreamSession], type[BaseException] | str]] = {
    "the session": ((_silent,), PreparedRunRequest, Answer, _no_session, Boom),
    "the answer, before it enters the run": ((_silent,), PreparedRunRequest, _Answer, _session,
                                            Boom),
    "the attempt's RunRequest bytes": ((_silent,), _Payload, Answer, _session, Boom),
    "the node client's start, a bug": ((_bug,), PreparedRunRequest, Answer, _session, Boom),
    "the node client's start, refused on each node": (
        (_refused, _refused), PreparedRunRequest, Answer, _session, NodeFailedError),
    "the retry's node client's start, a bug": (
        (_refused, _bug), PreparedRunRequest, Answer, _session, Boom),
    "the accept wait, the caller leaves": (
        (_no_accept,), PreparedRunRequest, Answer, _session, "cancel"),
    "the retry's accept wait, the caller leaves": (
        (_refused, _no_accept), PreparedRunRequest, Answer, _session, "cancel"),
    "the first batch, the caller leaves": (
        (_silent,), PreparedRunRequest, Answer, _session, "cancel"),
}  # fmt: skip


def _pool(starts: tuple[Start, ...], clock: Callable[[], float] = trio.current_time) -> NodePool:
    pool = NodePool([ScriptedClient(f"n{i}", start) for i, start in enumerate(starts)], clock=clock)
    for state in pool.nodes:
        pool.feed.described(state, NodeDescription(state.client.name, ("m",)))
        state.max_runs = 2
    return pool


@pytest.mark.parametrize("case", sorted(_CASES))
async def test_every_slot_comes_back_whatever_fails_in_a_run_start(case: str) -> None:
    """Whichever step of an answer's start fails (an exception, or the caller leaving
    there), on the first attempt or a retry, every node slot taken comes back."""
    starts, payload_type, answer_type, new_session, expected = _CASES[case]
    pool = _pool(starts)
    metrics = EdgeMetrics()
    admission = Admission(pool, AdmissionConfig(), metrics)
    timeouts = TimeoutsConfig(first_event_s=1000, idle_s=1000, total_s=10_000)
    runs = Runs(pool, timeouts, metrics, admission)
    failover = Failover(runs, RoutingConfig(retries=1, retry_backoff_s=0.0))
    answer = answer_type()
    payload = payload_type(b"", "r1")
    raised: list[BaseException] = []

    async def request(cancel_scope: trio.CancelScope) -> None:
        with cancel_scope:
            async with answer.serve():
                try:
                    plan = failover.plan(REQUEST, payload, request_id="req")
                    committed = await failover.start(answer, plan, new_session)
                    await committed.answer.first_batch()
                except Exception as exc:
                    raised.append(exc)

    cancel_scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, cancel_scope)
        await trio.testing.wait_all_tasks_blocked()
        if expected == "cancel":
            assert sum(state.in_flight for state in pool.nodes) == 1
            cancel_scope.cancel()
    if expected == "cancel":
        assert cancel_scope.cancelled_caught
        assert not raised
    else:
        assert len(raised) == 1
        assert type(raised[0]) is expected
    assert [state.in_flight for state in pool.nodes] == [0] * len(starts)


async def _fail_over_once(payload: PreparedRunRequest) -> None:
    pool = _pool((_refused, _refused))
    metrics = EdgeMetrics()
    admission = Admission(pool, AdmissionConfig(), metrics)
    timeouts = TimeoutsConfig(first_event_s=1000, idle_s=1000, total_s=10_000)
    failover = Failover(Runs(pool, timeouts, metrics, admission), RoutingConfig(retries=1))
    answer = Answer()
    async with answer.serve():
        with pytest.raises(NodeFailedError):
            await failover.start(answer, failover.plan(REQUEST, payload), _session)


async def test_a_start_that_failed_keeps_nothing_of_the_request() -> None:
    """A run whose start failed keeps its error, not the frames that raised it: once the
    request's scope is over, its 4 MiB RunRequest is freed by reference counting alone
    (with the collector off), not at a rare full collection."""
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        payload = PreparedRunRequest(b"x" * (4 << 20), "r1")
        await _fail_over_once(payload)
        del payload
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    assert held < 1 << 20


def _answering(*events: NodeEvent) -> Start:
    """A node that accepts the run and ends it with `events` (its read task over)."""

    async def start(nursery: trio.Nursery, request: EncodedRunRequest) -> RunHandle:
        handle = RunHandle(request.run_id, "n", EventBuffer(max_events=16, max_chars=1 << 20))
        for event in events:
            assert handle.events.put_nowait(event)
        handle.finished = True
        handle.events.close()
        handle.done.set()
        return handle

    return start


_REFUSAL = Failed("error", "context_length_exceeded", "too long", http_status=400)
_BUSY = Failed("error", "", "busy", http_status=429)
_ANSWER = (Delta("hi"), Complete())


@pytest.mark.parametrize(
    ("starts", "answered_by", "terminal"),
    [
        # A refusal answers at once: no other node is tried.
        ((_answering(_REFUSAL), _answering(*_ANSWER)), 0,
         ErrorOut("invalid_request_error", "too long", 400, "context_length_exceeded")),
        # 429: another node is tried, and answers.
        ((_answering(_BUSY), _answering(*_ANSWER)), 1, None),
        # 429 on every node: the last one's 429 answers.
        ((_answering(_BUSY), _answering(_BUSY)), 1,
         ErrorOut("rate_limit_exceeded", "busy", 429, None)),
    ],
)  # fmt: skip
async def test_a_refusal_is_not_retried_an_overload_is_and_no_breaker_counts_them(
    starts: tuple[Start, ...], answered_by: int, terminal: ErrorOut | None
) -> None:
    """A node's refusal (4xx) is the answer, from the first node; its overload (429) is
    tried on the next node. Neither moves a breaker (no failure counted, none reset), and
    each refusal is counted by node and status."""
    pool = _pool(starts)
    for state in pool.nodes:
        state.health.breaker.failures = 2  # failures in a row before: a success would reset them
    metrics = EdgeMetrics()
    admission = Admission(pool, AdmissionConfig(), metrics)
    timeouts = TimeoutsConfig(first_event_s=1000, idle_s=1000, total_s=10_000)
    failover = Failover(Runs(pool, timeouts, metrics, admission), RoutingConfig(retries=2))
    answer = Answer()
    async with answer.serve():
        plan = failover.plan(REQUEST, PreparedRunRequest(b"", "r1"))
        committed = await failover.start(answer, plan, _session)
        await committed.answer.end()
    assert committed.answer.run is not None
    assert committed.answer.run.info.node == f"n{answered_by}"
    assert committed.error == terminal
    assert [state.health.breaker.failures for state in pool.nodes] == [2, 2 if terminal else 0]
    assert [state.health.breaker.state for state in pool.nodes] == ["closed", "closed"]
    assert [state.in_flight for state in pool.nodes] == [0, 0]
    refusals = metrics.registry.get_sample_value
    first = 400 if terminal is not None and terminal.status == 400 else 429
    assert refusals("iop_edge_run_refusals_total", {"node": "n0", "status": str(first)}) == 1


async def test_a_refused_probe_frees_the_half_open_node_at_once() -> None:
    """A half-open node's probe run that the node refuses leaves the breaker half-open
    with its probe free: the next request probes it at once (no cooldown), and a success
    closes the breaker."""
    clock = [0.0]
    pool = _pool((_answering(_REFUSAL),), clock=lambda: clock[0])
    (state,) = pool.nodes
    for _ in range(pool.policy.breaker_failures):
        pool.run_failed(state, "error_event")
    clock[0] = pool.policy.cooldown_s
    metrics = EdgeMetrics()
    admission = Admission(pool, AdmissionConfig(), metrics)
    timeouts = TimeoutsConfig(first_event_s=1000, idle_s=1000, total_s=10_000)
    failover = Failover(Runs(pool, timeouts, metrics, admission), RoutingConfig(retries=0))
    answer = Answer()
    async with answer.serve():
        plan = failover.plan(REQUEST, PreparedRunRequest(b"", "r1"))
        committed = await failover.start(answer, plan, _session)
        await committed.answer.end()
    assert committed.error is not None
    assert committed.error.status == 400
    assert pool.state_of(state) == "half_open"
    assert state.health.admits(clock[0])
