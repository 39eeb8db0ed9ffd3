"""Migration: an answer whose run breaks after output goes on on another node.

The pure core in process: which ends move (`edge.fleet.continuation`), the answer so
far as it is kept (exact, bounded), and the whole move through a real `NodePool`,
`Admission`, `Runs`, `Failover` and `Answer`, over node clients whose runs the
tests script (in-process fakes of the node side only: a node that sends some output
then breaks, and one that continues from the RunRequest it is sent). The same over
real node processes is tests/integration/test_migration_e2e.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.api.messages_out import messages_usage
from edge.api.request import ChatRequest, parse_chat_request
from edge.config import AdmissionConfig, RoutingConfig, TimeoutsConfig
from edge.contract._proto.iop.node import v1 as pb
from edge.errors import NodeFailedError, NodeTimeoutError, NodeUnavailableError
from edge.fleet.admission import Admission
from edge.fleet.continuation import (
    JOIN_PARTS,
    RESERVE_CHARS,
    STALLED_CHARS,
    Delivered,
    failed_break,
    stream_break,
    why_not,
)
from edge.fleet.failover import Committed, Failover
from edge.fleet.pool import NodePool
from edge.fleet.runs import Runs
from edge.http.scope import ChatScope
from edge.node.bridge import EventBuffer
from edge.node.client import NodeDescription, RunHandle
from edge.node.wire import EncodedRunRequest, PreparedRunRequest
from edge.observe.metrics import EdgeMetrics
from edge.stream.events import (
    Complete,
    Delta,
    Failed,
    LogprobDelta,
    NodeEvent,
    ReasoningDelta,
    Usage,
)
from edge.stream.logprobs import TokenLogprob
from edge.stream.output import ContentOut, ErrorOut, FinishOut, OutEvent, ReasoningOut, RoleOut
from edge.stream.session import SessionSettings, StreamSession
from tests.unit.runkit import ScriptedClient

STREAM = parse_chat_request(
    b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
)
WHOLE = parse_chat_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
TIMEOUTS = TimeoutsConfig(first_event_s=1000, idle_s=1000, total_s=10_000)
BROKEN = NodeFailedError("the node's stream broke")


# --- which ends move ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (Failed("error", "boom"), "error_event"),
        (Failed("error", "boom", http_status=500), "error_event"),
        (Failed("error", "boom", http_status=503), "error_event"),
        (Failed("error", "slow upstream", http_status=408), "error_event"),
        (Failed("cancelled", "draining"), "node_drained"),
        (Failed("error", "too long", http_status=400), None),
        (Failed("error", "forbidden", http_status=403), None),
        (Failed("error", "busy", http_status=429), None),
    ],
)  # fmt: skip
def test_the_node_s_failures_move_a_refusal_or_an_overload_does_not(
    event: Failed, reason: str | None
) -> None:
    """An error event that is the node's failure (no status, 408, 5xx) or a `cancelled`
    (a drain) breaks the run; a refusal (4xx) or an overload (429) is the answer."""
    assert failed_break(event) == reason


def test_a_broken_stream_says_whether_its_node_went_away() -> None:
    """A node that cannot be reached any more is `node_gone`; any other break of the
    stream (reset, cut, ended without a terminal) is `stream_broken`."""
    assert stream_break(NodeUnavailableError("gone")).reason == "node_gone"
    assert stream_break(BROKEN).reason == "stream_broken"
    assert stream_break(None).reason == "stream_broken"


@pytest.mark.parametrize(
    ("left", "now", "gone", "why"),
    [(1, 0.0, None, None), (0, 0.0, None, "exhausted"), (2, 10.0, None, "expired"),
     (1, 0.0, "too_long", "too_long"), (1, 0.0, "stalled", "stalled")],
)  # fmt: skip
def test_why_an_answer_does_not_move(left: int, now: float, gone: str | None, why: str) -> None:
    """Before a node is looked for: migrations left, within the deadline, still kept."""
    assert why_not(migrations_left=left, now=now, deadline=10.0, gone=gone) == why


# --- the answer so far ---------------------------------------------------------------------


def test_the_answer_so_far_is_every_text_in_order_and_its_tokens() -> None:
    """Text and reasoning are kept apart, each exactly as sent (small pieces joined, long
    ones as they are); tokens: a delta one, a logprob delta its tokens."""
    delivered = Delivered(1 << 20)
    pieces = [f"t{i} " for i in range(3 * JOIN_PARTS + 5)]
    long = "L" * 10_000
    for piece in pieces:
        delivered.add(Delta(piece))
    delivered.add(Delta(long))
    delivered.add(ReasoningDelta("think "))
    delivered.add(ReasoningDelta("more"))
    delivered.add(LogprobDelta("ab", (TokenLogprob("a", -0.1), TokenLogprob("b", -0.2))))
    delivered.add(Delta(""))
    text, reasoning = delivered.parts()
    assert "".join(text) == "".join(pieces) + long + "ab"
    assert "".join(reasoning) == "think more"
    assert len(text) < len(pieces) // 100  # joined: about a byte a character
    assert delivered.tokens == len(pieces) + 1 + 2 + 2
    assert delivered.output


def test_the_answer_so_far_is_bounded_by_its_cap_and_the_memory_budget() -> None:
    """Past its cap, what is kept is let go and the answer cannot move (too_long); it is
    reserved from the memory budget in steps, and a budget with no room stops it too."""
    capped = Delivered(100)
    capped.add(Delta("x" * 60))
    assert capped.gone is None
    capped.add(ReasoningDelta("y" * 60))
    assert capped.gone == "too_long"
    assert capped.parts() == ([], [])
    assert capped.chars == 120
    steps: list[int] = []

    def reserve(chars: int) -> bool:
        steps.append(chars)
        return len(steps) < 3

    budgeted = Delivered(1 << 30, reserve)
    for _ in range(2 * RESERVE_CHARS // 1000):
        budgeted.add(Delta("z" * 1000))
    assert steps == [RESERVE_CHARS, RESERVE_CHARS]
    assert budgeted.gone is None
    budgeted.add(Delta("z" * 1000))
    assert budgeted.gone == "too_long"
    assert steps == [RESERVE_CHARS] * 3


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(st.text(max_size=40) | st.just("w" * 300), max_size=120),
    cap=st.integers(0, 6000),
    room=st.integers(0, 4),
)
def test_a_delta_kept_by_its_fast_path_is_kept_as_any_event_is(
    texts: list[str], cap: int, room: int
) -> None:
    """`Delivered.delta` (the tap's path for a plain delta) keeps what `_keep` keeps: the
    same parts, characters, tokens, cap and reservations, whatever the texts' sizes."""

    def budget(steps: list[int]) -> Callable[[int], bool]:
        return lambda chars: steps.append(chars) is None and len(steps) <= room

    fast_steps: list[int] = []
    slow_steps: list[int] = []
    fast, slow = Delivered(cap, budget(fast_steps)), Delivered(cap, budget(slow_steps))
    for text in texts:
        fast.delta(text)
        if text:
            slow.tokens += 1
            slow._keep(text, slow._text)
    assert (fast.parts(), fast.chars, fast.tokens, fast.gone) == (
        slow.parts(),
        slow.chars,
        slow.tokens,
        slow.gone,
    )
    assert fast_steps == slow_steps


def test_a_stalled_client_keeps_at_most_stalled_chars_of_its_answer() -> None:
    """Once its client stops reading, an answer keeps at most STALLED_CHARS: one past
    them at that moment is let go at once (`stalled`); one under them keeps its way to
    move until it passes them. What comes after is counted, not kept. A cap lower than
    the bound stays the cap (`too_long`). Cut as a slow client, nothing is kept."""
    long = Delivered(1 << 30)
    long.add(Delta("a" * STALLED_CHARS))
    long.add(ReasoningDelta("think"))
    long.stalled(cut=False)
    assert long.gone == "stalled"
    assert long.parts() == ([], [])
    long.delta("more")
    assert long.parts() == ([], [])
    assert (long.chars, long.tokens) == (STALLED_CHARS + 5 + 4, 3)
    short = Delivered(1 << 30)
    short.delta("abc")
    short.stalled(cut=False)
    assert short.gone is None
    short.delta("d" * (STALLED_CHARS - 3))
    assert short.gone is None
    assert "".join(short.parts()[0]) == "abc" + "d" * (STALLED_CHARS - 3)
    short.delta("e")
    assert (short.gone, short.parts()) == ("stalled", ([], []))
    small = Delivered(10)
    small.stalled(cut=False)
    small.delta("x" * 11)
    assert small.gone == "too_long"
    cut = Delivered(1 << 30)
    cut.delta("abc")
    cut.stalled(cut=False)
    cut.stalled(cut=True)  # ended as a slow client's: nothing is kept
    assert (cut.gone, cut.parts()) == ("stalled", ([], []))


def test_usage_sums_the_runs_input_as_each_node_reported_it() -> None:
    """Moved, the output tokens so far are the continuation's (its node counts them in
    its own usage); an error event's usage beats the count, and its input is added to
    the continuing run's input. Nothing changes without earlier runs or their input."""
    delivered = Delivered(1000)
    for piece in ("a", "b", "c"):
        delivered.add(Delta(piece))
    assert delivered.output_tokens == 3
    delivered.broke(Failed("error", "x", usage=Usage(input_tokens=30, output_tokens=5)))
    assert delivered.moved() == 5
    delivered.add(Delta("d"))
    assert delivered.output_tokens == 6
    complete = Complete(Usage(input_tokens=40, output_tokens=12, cached_input_tokens=8))
    assert delivered.summed(complete).usage == Usage(70, 12, 0, 8)
    # Anthropic's count of the moved answer: all its runs' prompts, the cached ones apart.
    anthropic = messages_usage(delivered.summed(complete).usage)
    assert (anthropic["input_tokens"], anthropic["cache_read_input_tokens"]) == (62, 8)
    assert delivered.summed(Complete()).usage is None
    assert Delivered(10).summed(complete) is complete
    unreported = Delivered(10)
    unreported.add(Delta("e"))
    unreported.broke(None)
    unreported.moved()
    assert unreported.summed(complete) is complete


# --- a move, through failover's runs -----------------------------------------------------
#
# Every node of a case plays the same script, by the RunRequest it is sent and the runs
# the fleet started before (which node the pool picks first is the pool's business).


class _Fleet:
    """The runs every node of a case was sent, in order, and the script they all play:
    `script(request, n)` for the fleet's run number `n` (0: the first)."""

    def __init__(self, script: Callable[[pb.RunRequest, int], Played]) -> None:
        self.script = script
        self.requests: list[tuple[str, pb.RunRequest]] = []


Played = tuple[list[NodeEvent], NodeFailedError | NodeUnavailableError | NodeTimeoutError | None]


def _node(name: str, fleet: _Fleet) -> ScriptedClient:
    """A node of the fleet: plays the fleet's script for each run it is sent."""

    async def start(nursery: trio.Nursery, request: EncodedRunRequest) -> RunHandle:
        message = pb.RunRequest().parse(bytes(request))
        runs = fleet.requests
        events, error = fleet.script(message, len(runs))
        runs.append((name, message))
        if isinstance(error, NodeUnavailableError):  # nothing starts: the node is gone
            raise error
        if isinstance(error, NodeTimeoutError):
            if error.sent:  # no accept before the request's deadline
                await trio.sleep(TIMEOUTS.total_s)
            raise error  # not sent: at the accept clock, which this fake does not keep
        handle = RunHandle(request.run_id, name, EventBuffer(max_events=64, max_chars=1 << 20))
        for event in events:
            assert handle.events.put_nowait(event)
        handle.finished = error is None
        handle.error = error
        handle.events.close()
        handle.done.set()
        return handle

    return ScriptedClient(name, start)


ANSWER = ["The ", "quick ", "brown ", "fox ", "jumps."]


def _continued(request: pb.RunRequest) -> Played:
    """Plays the answer from where the continuation leaves it, as the simulated node does,
    its usage the whole answer's (the contract: told output tokens counted in)."""
    done = request.continuation.text if request.continuation is not None else ""
    rest = "".join(ANSWER)[len(done) :]
    told = request.continuation.output_tokens if request.continuation is not None else 0
    usage = Usage(input_tokens=11, output_tokens=told + len(rest.split()))
    return [Delta(rest), Complete(usage, {"finish_reason": "stop"})], None


def _first_breaks(n: int, end: Failed | None = None) -> Callable[[pb.RunRequest, int], Played]:
    """The fleet's first run sends the answer's first `n` pieces, then breaks: `end` (an
    event), else its stream; every later run answers (continued, or whole)."""

    def script(request: pb.RunRequest, run: int) -> Played:
        if run:
            return _continued(request)
        events: list[NodeEvent] = [Delta(p) for p in ANSWER[:n]]
        return ([*events, end], None) if end is not None else (events, BROKEN)

    return script


async def _answer(
    fleet: _Fleet,
    *,
    continuation: tuple[bool, ...],
    request: ChatRequest = STREAM,
    migrations: int = 1,
    retries: int = 0,
) -> tuple[list[OutEvent], Committed, EdgeMetrics, NodePool]:
    """Everything the caller of `Failover.start` takes of one answer, to its end, from
    nodes n0, n1, ... (one a `continuation` flag)."""
    pool = NodePool([_node(f"n{i}", fleet) for i in range(len(continuation))])
    for state, can in zip(pool.nodes, continuation, strict=True):
        name = state.client.name
        pool.feed.described(
            state,
            NodeDescription(name, ("m",), continuation_models=frozenset({"m"} if can else ())),
        )
        state.max_runs = 2
    metrics = EdgeMetrics()
    admission = Admission(pool, AdmissionConfig(), metrics)
    runs = Runs(pool, TIMEOUTS, metrics, admission)
    routing = RoutingConfig(retries=retries, retry_backoff_s=0.0, migrations=migrations)
    failover = Failover(runs, routing)
    # The request's scope, as the app opens it: it counts the request, once.
    scope = ChatScope(metrics)
    answer = scope.answer
    out: list[OutEvent] = []
    async with scope.serve():
        payload = PreparedRunRequest(bytes(pb.RunRequest(run_id="r1", model="m")), "r1")
        committed = await failover.start(
            answer, failover.plan(request, payload, request_id="req"),
            lambda: StreamSession(SessionSettings(run_id="r1", whole_output=request is WHOLE)),
        )  # fmt: skip
        out.extend(committed.first)
        while not answer.session.terminated:
            batch = await answer.next_batch()
            assert batch != "keepalive"
            out.extend(batch)
        out.extend(answer.session.drain())
        await answer.end()
        scope.settled()
    assert [state.in_flight for state in pool.nodes] == [0] * len(continuation)
    return out, committed, metrics, pool


def _node_of(committed: Committed) -> str:
    """The node of the run that answered."""
    run = committed.answer.run
    assert run is not None
    return run.info.node


def _text(out: list[OutEvent]) -> str:
    return "".join(e.text for e in out if isinstance(e, ContentOut))


def _terminals(out: list[OutEvent]) -> list[OutEvent]:
    return [e for e in out if isinstance(e, (FinishOut, ErrorOut))]


def _migrations(metrics: EdgeMetrics, reason: str, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "iop_edge_migrations_total", {"reason": reason, "outcome": outcome}
    )
    return value or 0.0


@pytest.mark.parametrize(
    ("end", "reason"),
    [(None, "stream_broken"), (Failed("error", "upstream 500", http_status=500), "error_event"),
     (Failed("cancelled", "the node is draining"), "node_drained")],
)  # fmt: skip
async def test_a_stream_broken_after_output_goes_on_on_a_node_that_can_continue(
    end: Failed | None, reason: str
) -> None:
    """The stream's text is the whole answer, once: one role chunk, one terminal (stop),
    the usage the whole answer's; the continuing node (another) got exactly the text so
    far under the same run id, and the migration is counted by its reason. The broken
    run's failure after output is not counted on its node's breaker."""
    fleet = _Fleet(_first_breaks(3, end))
    out, committed, metrics, pool = await _answer(fleet, continuation=(True, True))
    assert _text(out) == "".join(ANSWER)
    assert out.count(RoleOut()) == 1
    (terminal,) = _terminals(out)
    assert isinstance(terminal, FinishOut)
    assert terminal.finish_reason == "stop"
    assert terminal.usage == Usage(input_tokens=11, output_tokens=3 + 2)
    (broke_on, first), (continued_on, continued) = fleet.requests
    assert continued_on != broke_on
    assert first.continuation is None
    assert continued.continuation is not None
    assert continued.continuation.text == "".join(ANSWER[:3])
    assert continued.continuation.reasoning == ""
    assert continued.continuation.output_tokens == 3
    assert continued.run_id == "r1"
    assert _node_of(committed) == continued_on
    assert _migrations(metrics, reason, "migrated") == 1
    assert metrics.registry.get_sample_value("iop_edge_migration_gap_seconds_count") == 1
    assert [state.health.breaker.failures for state in pool.nodes] == [0, 0]


async def test_reasoning_and_text_so_far_both_continue() -> None:
    """A run that reasoned, then wrote, then broke: the continuation carries both, apart,
    and the caller's reasoning and text are each whole, once."""

    def reasons(request: pb.RunRequest, run: int) -> Played:
        if run:
            return _continued(request)
        return [ReasoningDelta("Let me "), ReasoningDelta("think."), Delta("The ")], BROKEN

    fleet = _Fleet(reasons)
    out, _, _, _ = await _answer(fleet, continuation=(True, True))
    assert "".join(e.text for e in out if isinstance(e, ReasoningOut)) == "Let me think."
    assert _text(out) == "".join(ANSWER)
    continuation = fleet.requests[1][1].continuation
    assert continuation is not None
    assert (continuation.text, continuation.reasoning) == ("The ", "Let me think.")


@pytest.mark.parametrize(
    ("continuation", "migrations", "end", "outcome"),
    [((False, False), 1, None, "no_node"),  # no node can continue
     ((True, True), 0, None, None),  # migration off: nothing kept, nothing counted
     ((True, True), 1, Failed("error", "too long", http_status=400), None),  # a refusal
     ((True, True), 1, Failed("error", "busy", http_status=429), None)],  # an overload
)  # fmt: skip
async def test_an_answer_that_cannot_move_ends_with_an_error_frame_as_before(
    continuation: tuple[bool, bool], migrations: int, end: Failed | None, outcome: str | None
) -> None:
    """No node that can continue, migration off, or an end that is the request's answer:
    the stream ends as it did before migration (the text so far, one error frame), and
    no other node is asked."""
    fleet = _Fleet(_first_breaks(2, end))
    out, committed, metrics, _ = await _answer(
        fleet, continuation=continuation, migrations=migrations
    )
    assert _text(out) == "".join(ANSWER[:2])
    (terminal,) = _terminals(out)
    assert isinstance(terminal, ErrorOut)
    ((node, _),) = fleet.requests
    assert _node_of(committed) == node
    counted = _migrations(metrics, "stream_broken", outcome) if outcome is not None else 0
    assert counted == (1 if outcome is not None else 0)


async def test_an_answer_moves_at_most_migrations_times() -> None:
    """A continuation that breaks too, with no migration left: its error frame ends the
    stream (the text so far whole, once), and the limit is counted."""

    def breaks_twice(request: pb.RunRequest, run: int) -> Played:
        if run == 0:
            return [Delta(p) for p in ANSWER[:3]], BROKEN
        if run == 1:
            return [Delta("fox ")], BROKEN
        return _continued(request)

    fleet = _Fleet(breaks_twice)
    out, _, metrics, _ = await _answer(fleet, continuation=(True, True, True))
    assert _text(out) == "".join(ANSWER[:4])
    (terminal,) = _terminals(out)
    assert isinstance(terminal, ErrorOut)
    assert len(fleet.requests) == 2
    assert _migrations(metrics, "stream_broken", "migrated") == 1
    assert _migrations(metrics, "stream_broken", "exhausted") == 1


def _never_sent() -> NodeTimeoutError:
    error = NodeTimeoutError("the run could not be sent to node n in 1.5s")
    error.sent = False
    return error


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(lambda: NodeUnavailableError("node is unreachable"), id="unreachable"),
        pytest.param(_never_sent, id="never-sent"),
    ],
)
async def test_a_continuation_that_does_not_start_tries_another_node(
    failure: Callable[[], NodeUnavailableError | NodeTimeoutError],
) -> None:
    """The node picked for the continuation is gone (it died since the pool last heard of
    it), or its RunRequest was never written to it (a request parked on a connection
    that was lost, until the accept clock: vmagamedov/grpclib#216): nothing runs there,
    so the continuation starts on a node not tried yet, the answer is whole, once, and
    the break is counted once, as a migration. (One written and never accepted does not
    move on: test_a_continuation_the_deadline_stopped_is_counted_expired.)"""

    def gone_then_continued(request: pb.RunRequest, run: int) -> Played:
        if run == 0:
            return [Delta(p) for p in ANSWER[:3]], BROKEN
        if run == 1:
            return [], failure()
        return _continued(request)

    fleet = _Fleet(gone_then_continued)
    out, committed, metrics, _ = await _answer(fleet, continuation=(True, True, True))
    assert _text(out) == "".join(ANSWER)
    (terminal,) = _terminals(out)
    assert isinstance(terminal, FinishOut)
    assert len({node for node, _ in fleet.requests}) == 3
    assert _node_of(committed) == fleet.requests[2][0]
    assert _migrations(metrics, "stream_broken", "migrated") == 1
    assert _migrations(metrics, "stream_broken", "failed") == 0


async def test_a_continuation_the_deadline_stopped_is_counted_expired(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The continuation's node accepted nothing before the request's total deadline: the
    answer ends with an error frame (the text so far, once), counted as expired (the
    request's deadline), not as a failed move."""

    def never_accepted(request: pb.RunRequest, run: int) -> Played:
        if run == 0:
            return [Delta(p) for p in ANSWER[:3]], BROKEN
        return [], NodeTimeoutError("node did not accept the run before its deadline")

    fleet = _Fleet(never_accepted)
    out, _, metrics, _ = await _answer(fleet, continuation=(True, True, True))
    assert _text(out) == "".join(ANSWER[:3])
    (terminal,) = _terminals(out)
    assert isinstance(terminal, ErrorOut)
    assert _migrations(metrics, "stream_broken", "expired") == 1
    assert _migrations(metrics, "stream_broken", "failed") == 0


async def test_a_stream_broken_before_output_is_restarted_not_continued() -> None:
    """Before the commit point nothing reached the caller: failover restarts the answer
    on another node (no continuation sent), as before migration."""
    fleet = _Fleet(_first_breaks(0))
    out, _, metrics, _ = await _answer(fleet, continuation=(True, True), retries=1)
    assert _text(out) == "".join(ANSWER)
    assert fleet.requests[1][1].continuation is None
    assert _migrations(metrics, "stream_broken", "migrated") == 0


async def test_a_non_streaming_answer_broken_late_continues_rather_than_restarts() -> None:
    """Not streamed: a run that broke after output is continued on a node that can (its
    text so far sent, not produced again), and the answer is whole."""
    fleet = _Fleet(_first_breaks(4))
    out, committed, metrics, _ = await _answer(
        fleet, continuation=(True, True), request=WHOLE, retries=1
    )
    assert _text(out) == "".join(ANSWER)
    assert committed.error is None
    continuation = fleet.requests[1][1].continuation
    assert continuation is not None
    assert continuation.text == "".join(ANSWER[:4])
    assert _migrations(metrics, "stream_broken", "migrated") == 1


async def test_a_non_streaming_answer_that_cannot_continue_is_restarted_as_before() -> None:
    """Not streamed, and no node can continue: failover restarts it from the start on the
    other node (whole, once), as before migration."""
    fleet = _Fleet(_first_breaks(4))
    out, _, metrics, _ = await _answer(fleet, continuation=(False, False), request=WHOLE, retries=1)
    assert _text(out) == "".join(ANSWER)
    assert fleet.requests[1][1].continuation is None
    assert _migrations(metrics, "stream_broken", "no_node") == 1


async def test_a_non_streaming_answer_whose_continuation_breaks_is_restarted_and_counted_once() -> (
    None
):
    """Not streamed: the continuation breaks too, with no migration left; nothing was
    sent, so failover starts the answer again on the node left, which answers it whole.
    The request is counted once, with the answer's outcome (success), not the broken
    continuation's."""

    def breaks_twice(request: pb.RunRequest, run: int) -> Played:
        if run == 0:
            return [Delta(p) for p in ANSWER[:3]], BROKEN
        if run == 1:
            return [Delta("fox ")], BROKEN
        return _continued(request)

    fleet = _Fleet(breaks_twice)
    out, committed, metrics, _ = await _answer(
        fleet, continuation=(True, True, True), request=WHOLE, retries=1
    )
    assert _text(out) == "".join(ANSWER)
    assert committed.error is None
    assert fleet.requests[2][1].continuation is None  # started again, from the start
    counted = [
        (sample.labels["status"], sample.labels["node"], sample.value)
        for family in metrics.registry.collect() if family.name == "iop_edge_requests"
        for sample in family.samples if sample.name == "iop_edge_requests_total"
    ]  # fmt: skip
    assert counted == [("success", fleet.requests[2][0], 1.0)]


def test_the_answer_so_far_is_reserved_from_the_memory_budget_without_shedding() -> None:
    """What a running answer keeps comes out of the memory budget while there is room;
    past it the reservation is refused (None) and nothing is counted as shed."""
    metrics = EdgeMetrics()
    admission = Admission(NodePool([]), AdmissionConfig(memory_budget_bytes=1000), metrics)
    give_back = admission.try_hold(600)
    assert give_back is not None
    assert admission.try_hold(600) is None
    give_back()
    assert admission.try_hold(600) is not None
    assert metrics.registry.get_sample_value(
        "iop_edge_shed_total", {"reason": "memory_budget"}
    ) in (
        None,
        0.0,
    )
