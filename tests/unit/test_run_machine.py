"""A run's life under random event orders: the invariants hold whatever happens.

Hypothesis plays two nodes (each a script of events, silences, a broken stream, a
hang) and a client (reads to the end, leaves after some batches, or is drained
after some), with trio's MockClock running every deadline. The answer goes
through the product's own objects: a real `NodePool`, `Admission`, `Runs`,
`Failover` (one retry, one migration) and `Answer`, over the real
`GrpcNodeClient`'s start and read task, whose node side (`read_events`, the
documented seam `edge.nodes.direct` uses) plays the script, and whose CancelRun
(`cancel_on_node`) is counted instead of sent.

Whatever the order, after the request:
- the client got exactly one terminal when it read to the end (none cut twice);
- each run got at most one CancelRun, and none once the node ended it;
- every node slot came back once (no slot taken, none given back twice), no run
  is in flight (the stream gauge back at 0), and every run went through its phases
  to RETIRED (an illegal
  step raises `IllegalTransition` and fails the case).
"""

from __future__ import annotations

from dataclasses import dataclass

import trio
import trio.testing
from hypothesis import event, given
from hypothesis import strategies as st

from edge.api.request import parse_chat_request
from edge.config import AdmissionConfig, RoutingConfig, TimeoutsConfig
from edge.errors import EdgeError, NodeFailedError
from edge.fleet.admission import Admission
from edge.fleet.answer import Answer
from edge.fleet.failover import Failover
from edge.fleet.phase import Phase
from edge.fleet.pool import NodePool
from edge.fleet.runs import Runs
from edge.node.bridge import EventBuffer
from edge.node.client import NodeDescription
from edge.node.grpc import Accepted
from edge.node.wire import PreparedRunRequest
from edge.observe.metrics import EdgeMetrics
from edge.stream.events import Complete, Delta, Failed, NodeEvent, ReasoningDelta, Usage
from edge.stream.output import ErrorOut, FinishOut, OutEvent
from edge.stream.session import SessionSettings, StreamSession
from tests.unit.runkit import PlayedClient

TIMEOUTS = TimeoutsConfig(first_event_s=5, idle_s=4, total_s=30)

# A node's step: an event, a silence (seconds), the stream breaking, or a hang.
Step = NodeEvent | float | str

_events = st.one_of(
    st.builds(Delta, st.sampled_from(["a", "bc ", "<think>", "</think>", "word "])),
    st.builds(ReasoningDelta, st.just("hm ")),
    st.just(Complete(Usage(input_tokens=3, output_tokens=2), {"finish_reason": "stop"})),
    st.just(Failed("error", "the node failed")),
    st.just(Failed("cancelled", "the node cancelled the run")),
)
_steps = st.lists(
    st.one_of(_events, st.sampled_from([0.5, 3.0, 4.5, 6.0]), st.sampled_from(["break", "hang"])),
    max_size=8,
)


@dataclass(frozen=True)
class Client:
    """What the client does: "read" to the end, "leave" or "drain" after `after` batches."""

    does: str
    after: int


_clients = st.builds(Client, st.sampled_from(["read", "leave", "drain"]), st.integers(0, 4))


class ScriptNode(PlayedClient):
    """The product's gRPC node client, its node side playing `script` for every run."""

    def __init__(self, name: str, script: list[Step]) -> None:
        super().__init__(name)
        self.script = script

    async def play(self, events: EventBuffer) -> None:
        events.mark_sent()
        await _put(events, Accepted(""))
        for step in self.script:
            if step == "break":
                raise NodeFailedError(f"node {self.name}: the stream broke")
            if step == "hang":
                await trio.sleep_forever()
            if isinstance(step, float):
                await trio.sleep(step)
                continue
            assert not isinstance(step, str)
            await _put(events, step)
            if isinstance(step, (Complete, Failed)):
                return
        raise NodeFailedError(f"node {self.name}: the run ended without a terminal event")


async def _put(events: EventBuffer, item: object) -> None:
    if not events.put_nowait(item):  # type: ignore[arg-type]
        await events.wait_put(item)  # type: ignore[arg-type]


def _terminals(out: list[OutEvent]) -> int:
    return sum(isinstance(event, (FinishOut, ErrorOut)) for event in out)


async def _request(
    failover: Failover,
    answer: Answer,
    stream: bool,
    client: Client,
    runs: Runs,
    out: list[OutEvent],
    leave: trio.CancelScope,
) -> None:
    """The request's answer as the HTTP layer takes it: start, first batch, then batches
    until the session's terminal (or the client leaves, or the edge drains)."""
    body = b'{"model": "m", "stream": %s, "messages": [{"role": "user", "content": "hi"}]}'
    request = parse_chat_request(body % (b"true" if stream else b"false"))
    payload = PreparedRunRequest(b"", "r1")

    def new_session() -> StreamSession:
        return StreamSession(SessionSettings(run_id="r1", whole_output=not stream))

    committed = await failover.start(answer, failover.plan(request, payload), new_session)
    out.extend(committed.first)
    batches = 0
    try:
        while not answer.session.terminated:
            if batches == client.after and client.does == "leave":
                leave.cancel()  # the client is gone: its request's task is cancelled
                await trio.lowlevel.checkpoint()
            if batches == client.after and client.does == "drain":
                runs.shut_down("the edge is shutting down")
            batch = await answer.next_batch()
            batches += 1
            if batch != "keepalive":
                out.extend(batch)
        out.extend(answer.session.drain())
    finally:
        await answer.end()


async def _case(first: list[Step], second: list[Step], client: Client, stream: bool) -> None:
    nodes = [ScriptNode("n0", first), ScriptNode("n1", second)]
    pool = NodePool(list(nodes), clock=trio.current_time)
    for state in pool.nodes:
        description = NodeDescription(
            state.client.name, ("m",), continuation_models=frozenset({"m"})
        )
        pool.feed.described(state, description)
        state.max_runs = 2
    metrics = EdgeMetrics()
    admission = Admission(pool, AdmissionConfig(), metrics)
    runs = Runs(pool, TIMEOUTS, metrics, admission)
    routing = RoutingConfig(retries=1, retry_backoff_s=0.0, migrations=1)
    failover = Failover(runs, routing)
    answer = Answer()
    out: list[OutEvent] = []
    refused = False
    with trio.CancelScope() as leave:
        async with answer.serve():
            try:
                await _request(failover, answer, stream, client, runs, out, leave)
            except EdgeError:
                refused = True  # every attempt failed before any byte: a real status
    if client.does != "leave" and not refused:
        assert _terminals(out) == 1, out
    assert _terminals(out) <= 1, out
    for node in nodes:
        assert all(count == 1 for count in node.cancels.values()), node.cancels
    assert [state.in_flight for state in pool.nodes] == [0, 0]
    assert not runs.live
    # Each accepted run left the stream gauge once, whichever way it ended.
    assert metrics.registry.get_sample_value("iop_edge_active_streams") == 0
    assert answer.attempts
    event(f"runs: {len(answer.attempts)}")
    event(f"migrated: {any(mark.what == 'migrated' for mark in answer.journal)}")
    event(f"cancels: {sum(sum(node.cancels.values()) for node in nodes)}")
    event(f"refused: {refused}")
    assert all(run.machine.phase is Phase.RETIRED for run in answer.attempts)


@given(first=_steps, second=_steps, client=_clients, stream=st.booleans())
def test_a_run_keeps_its_invariants_whatever_the_order_of_events(
    first: list[Step], second: list[Step], client: Client, stream: bool
) -> None:
    """Random node scripts on two nodes, and a client that reads, leaves or is drained:
    one terminal, at most one CancelRun a run, every slot back once, every run retired."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    trio.run(_case, first, second, client, stream, clock=clock)
