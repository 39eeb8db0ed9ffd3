"""The pool's pick (edge.fleet.pool): eligibility, slots, panic routing, affinity, breakers.

The nodes' states are set as their Describe answers and the runs' verdicts
would set them; the pool's clock is a number the tests move. No node is
contacted: pick and the verdicts are pure bookkeeping (the background task
and the real nodes are in tests/integration/test_fleet_e2e.py).
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.config import RoutingConfig
from edge.errors import NodeUnavailableError, NotFoundError, RequestError
from edge.fleet import affinity, readiness
from edge.fleet.affinity import SessionKey
from edge.fleet.nodestate import NodeState, Tried
from edge.fleet.pool import NodePool
from edge.fleet.verdict import Verdict
from edge.node.client import NodeClient, NodeDescription

MODELS = ("m", "other")


@dataclass
class _Named:
    """Only what the pool reads of a client when it is not talking to it."""

    name: str
    address: str = "127.0.0.1:1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_pool(
    *names: str,
    routing: RoutingConfig | None = None,
    max_runs: dict[str, int] | None = None,
    describe_max_runs: int = 0,
    logprobs: tuple[str, ...] = (),
) -> tuple[NodePool, Clock, list[NodeState]]:
    clock = Clock()
    clients = [cast(NodeClient, _Named(n)) for n in names]
    pool = NodePool(clients, routing=routing, max_runs=max_runs, clock=clock)
    for state in pool.nodes:
        description = NodeDescription(
            state.client.name, MODELS, max_runs=describe_max_runs,
            logprobs_models=frozenset(logprobs),
        )  # fmt: skip
        pool.feed.described(state, description)
    return pool, clock, pool.nodes


def test_least_loaded_picks_the_lightest_node() -> None:
    """The healthy node with the fewest runs in flight, wherever it is listed."""
    pool, _, (a, b, c) = make_pool("a", "b", "c")
    for loads, lightest in (((2, 1, 3), b), ((0, 1, 1), a), ((2, 2, 1), c)):
        for state, runs in zip((a, b, c), loads, strict=True):
            state.in_flight = runs
        for _ in range(4):
            assert pool.pick("m") is lightest


@given(st.integers(2, 6), st.integers(1, 5))
def test_least_loaded_shares_ties_evenly(count: int, rounds: int) -> None:
    """Between nodes of equal load the picks go round: over `count` x `rounds` picks each
    node gets exactly `rounds`, not the first listed all of them."""
    pool, _, nodes = make_pool(*(f"n{i}" for i in range(count)))
    picks = Counter(pool.pick("m") for _ in range(count * rounds))
    assert [picks[state] for state in nodes] == [rounds] * count


def test_least_loaded_ties_among_the_lightest_only() -> None:
    """The turn breaks ties only: with two light nodes and one busy, the busy one gets
    nothing and the light ones alternate."""
    pool, _, (a, b, c) = make_pool("a", "b", "c")
    b.in_flight = 3
    picks = Counter(pool.pick("m") for _ in range(10))
    assert picks == Counter({a: 5, c: 5})


def test_excluded_nodes_are_skipped_and_all_excluded_is_unavailable() -> None:
    """A node a run already tried is not picked again; with every node excluded the
    answer is NodeUnavailableError (no panic routing onto a node that just failed)."""
    pool, _, (a, b) = make_pool("a", "b")
    assert pool.pick("m", exclude=[a]) is b
    assert pool.pick("m", exclude={a}) is b
    with pytest.raises(NodeUnavailableError):
        pool.pick("m", exclude=[a, b])


def test_a_node_tried_is_excluded_until_it_restarts() -> None:
    """A request's tried nodes stay excluded in the life its run reached (the instance
    the node named in the run's accept): one that failed it and lives on stays out, even
    down and up again; one the edge saw report another instance since (a restart) may
    take the request; one whose run got no accept, that names no life, or whose run
    reached a life the edge has not seen end, stays out."""
    pool, clock, (a, b, c) = make_pool("a", "b", "c")
    for state, life in ((a, "a1"), (b, "b1")):
        pool.feed.described(state, NodeDescription(state.client.name, MODELS, instance=life))
    tried = Tried()
    tried.add(a, "a1")  # its run was accepted by a1
    tried.add(b)  # its run got no accept
    tried.add(c, "c1")  # c names no life in its reports
    assert (a in tried, b in tried, c in tried, len(tried)) == (True, True, True, 3)
    with pytest.raises(NodeUnavailableError):
        pool.pick("m", exclude=tried)
    assert a.health.mark_down(clock.now, "refused a run")
    pool.feed.described(a, NodeDescription("a", MODELS, instance="a1"))  # the same life
    assert a in tried
    pool.feed.described(a, NodeDescription("a", MODELS, instance="a2"))  # restarted
    pool.feed.described(b, NodeDescription("b", MODELS, instance="b2"))
    assert (a in tried, b in tried, list(tried)) == (False, True, [b, c])
    assert pool.pick("m", exclude=tried) is a
    tried.add(a, "a2")  # tried again, in this life
    assert a in tried
    # A run that reached a life the edge had not heard of yet (the restart raced the
    # run): that life has not ended, whatever the edge knew before; the node stays out.
    tried.add(b, "b3")
    pool.feed.described(b, NodeDescription("b", MODELS, instance="b3"))
    assert b in tried
    # A run that never reached its node (no connection: the RunRequest not written) does
    # not count as tried there: the node's health keeps it out while it is down.
    tried.add(b, None)
    assert b not in tried
    # Empty when every node it holds may take the request again (a's life a1 ended).
    again = Tried()
    assert not again
    again.add(a, "a1")
    assert (bool(again), len(again)) == (False, 0)


def test_a_restarted_node_starts_with_an_empty_cache_index() -> None:
    """A new instance id: the approximate index of what the node's KV cache holds is
    forgotten (the cache went with the old process)."""
    pool, _, (a,) = make_pool("a")
    pool.feed.described(a, NodeDescription("a", MODELS, instance="a1"))
    a.cache.resize(16)
    a.cache.routed(array("Q", [1, 2, 3]), 0)
    assert len(a.cache) == 3
    pool.feed.described(a, NodeDescription("a", MODELS, instance="a1"))
    assert len(a.cache) == 3
    pool.feed.described(a, NodeDescription("a", MODELS, instance="a2"))
    assert len(a.cache) == 0


def test_slots_none_when_every_eligible_node_is_full() -> None:
    """max_runs caps runs in flight: a full node is passed over; when every eligible node
    is full the answer is None (the caller queues), not an error."""
    pool, _, (a, b) = make_pool("a", "b", max_runs={"a": 1, "b": 2})
    assert (a.max_runs, b.max_runs) == (1, 2)
    a.in_flight = 1
    assert pool.pick("m") is b
    b.in_flight = 2
    assert not a.has_slot()
    assert pool.pick("m") is None
    b.in_flight = 1
    assert pool.pick("m") is b


@pytest.mark.parametrize(
    ("configured", "described", "expected"),
    [
        (None, 0, math.inf),  # neither says: unlimited
        (None, 8, 8),  # the node's own Describe max_runs
        (3, 8, 3),  # the config wins
        (0, 8, math.inf),  # 0 in the config: no limit whatever the node says
    ],
)
def test_max_runs_comes_from_the_config_else_describe_else_unlimited(
    configured: int | None, described: int, expected: float
) -> None:
    """[[nodes]] max_runs, else Describe's max_runs (0 = none), else no limit."""
    caps = {} if configured is None else {"a": configured}
    pool, _, (a,) = make_pool("a", max_runs=caps, describe_max_runs=described)
    assert a.max_runs == expected
    assert readiness.status(pool)[0]["max_runs"] == (None if math.isinf(expected) else expected)


def test_unknown_model_logprobs_and_never_contacted() -> None:
    """No node serves the model: 404; nodes serve it but without logprobs: 400 naming
    logprobs; a model unknown while some node never answered: 503 (it may serve it)."""
    pool, _, (a, b) = make_pool("a", "b", logprobs=("other",))
    with pytest.raises(NotFoundError):
        pool.pick("nope")
    with pytest.raises(RequestError) as caught:
        pool.pick("m", logprobs=True)
    assert caught.value.param == "logprobs"
    b.in_flight = 1
    assert pool.pick("other", logprobs=True) is a
    silent = NodePool([cast(NodeClient, _Named("x"))], clock=Clock())
    with pytest.raises(NodeUnavailableError):
        silent.pick("m")


def test_a_node_marked_down_gets_no_runs_while_another_is_up() -> None:
    """A refused run takes the node out of routing at once."""
    pool, _, (a, b) = make_pool("a", "b")
    pool.mark_down(a, "connection refused")
    assert pool.state_of(a) == "down"
    for _ in range(3):
        assert pool.pick("m") is b


def test_panic_routing_tries_the_least_recently_failed_down_node() -> None:
    """Every node serving the model is marked down: pick still returns one, the one whose
    last failure is the oldest; excluded nodes are not tried; a full one neither."""
    pool, clock, (a, b, c) = make_pool("a", "b", "c")
    pool.mark_down(b, "refused")
    clock.now += 1
    pool.mark_down(a, "refused")
    clock.now += 1
    pool.mark_down(c, "refused")
    assert not readiness.ready(pool)
    assert pool.pick("m") is b
    assert pool.pick("m", exclude=[b]) is a
    with pytest.raises(NodeUnavailableError):
        pool.pick("m", exclude=[a, b, c])
    pool2, _, (x,) = make_pool("x", max_runs={"x": 1})
    pool2.mark_down(x, "refused")
    x.in_flight = 1
    assert pool2.pick("m") is None


def test_a_panic_run_that_succeeds_brings_its_node_back() -> None:
    """The run panic routing sent works: the node is up again for everyone."""
    pool, _, (a,) = make_pool("a")
    pool.mark_down(a, "refused")
    available: list[int] = []
    pool.on_available = lambda: available.append(1)
    chosen = pool.pick("m")
    assert chosen is a
    pool.run_succeeded(a)
    assert pool.state_of(a) == "up"
    assert available == [1]


def test_the_breaker_keeps_runs_off_and_half_opens_for_one_probe() -> None:
    """breaker_failures failed runs: no new runs on the node (another takes them; alone,
    503 at once, never panic routing); after the cooldown exactly one probe run; its
    success closes the breaker."""
    routing = RoutingConfig(breaker_failures=2, breaker_cooldown_s=5.0)
    pool, clock, (a, b) = make_pool("a", "b", routing=routing)
    pool.run_failed(a, "error_event")
    assert pool.state_of(a) == "up"
    pool.run_failed(a, "error_event")
    assert pool.state_of(a) == "open"
    assert pool.pick("m") is b
    with pytest.raises(NodeUnavailableError, match="circuit"):
        pool.pick("m", exclude=[b])
    clock.now += 5.0
    assert pool.state_of(a) == "half_open"
    b.in_flight = 3
    assert pool.pick("m") is a  # the probe
    assert pool.pick("m") is b  # the probe is out: a takes nothing else
    with pytest.raises(NodeUnavailableError):
        pool.pick("m", exclude=[b])
    pool.run_succeeded(a)
    assert pool.state_of(a) == "up"
    assert pool.pick("m") is a
    assert pool.pick("m") is a


def test_a_failed_probe_opens_the_breaker_again() -> None:
    """Half-open, the probe run fails: open for another whole cooldown."""
    routing = RoutingConfig(breaker_failures=1, breaker_cooldown_s=2.0)
    pool, clock, (a,) = make_pool("a", routing=routing)
    pool.run_failed(a, "error_event")
    clock.now += 2.0
    assert pool.pick("m") is a
    pool.run_failed(a, "error_event")
    assert pool.state_of(a) == "open"
    clock.now += 1.9
    with pytest.raises(NodeUnavailableError):
        pool.pick("m")
    clock.now += 0.1
    assert pool.pick("m") is a


def test_ready_and_status_show_each_state() -> None:
    """/readyz's node list names each node's state; the gauge's value follows it; the
    edge is ready while some node is up or half-open."""
    routing = RoutingConfig(breaker_failures=1, breaker_cooldown_s=5.0)
    pool, clock, (a, b) = make_pool("a", "b", routing=routing)
    pool.mark_down(b, "refused")
    pool.run_failed(a, "error_event")
    assert [s["state"] for s in readiness.status(pool)] == ["open", "down"]
    assert [readiness.state_value(pool, s) for s in (a, b)] == [3, 0]
    assert not readiness.ready(pool)
    clock.now += 5
    assert [s["state"] for s in readiness.status(pool)] == ["half_open", "down"]
    assert readiness.state_value(pool, a) == 2
    assert readiness.ready(pool)
    status = readiness.status(pool)[0]
    assert status["failed_runs_in_a_row"] == 1
    assert status["healthy"] is True


def test_affinity_sends_a_session_to_its_node_and_spills_when_it_runs_hot() -> None:
    """Under the affinity policy the same key (a named session or a `user`) lands on the
    same node while its load is within bounds; past it, on the key's next node; without a
    key, least loaded."""
    routing = RoutingConfig(policy="affinity")
    pool, _, nodes = make_pool("a", "b", "c", routing=routing)
    names = [s.client.name for s in nodes]
    for key in (SessionKey("s1"), SessionKey("s2"), SessionKey("user-7", named=False)):
        first, second = affinity.order(key.key, names)[:2]
        assert pool.pick("m", affinity_key=key) is nodes[first]
        assert pool.pick("m", affinity_key=key) is nodes[first]
        nodes[first].in_flight = 10
        assert pool.pick("m", affinity_key=key) is nodes[second]
        nodes[first].in_flight = 0
    nodes[0].in_flight = nodes[2].in_flight = 1
    assert pool.pick("m") is nodes[1]


def test_affinity_skips_nodes_that_cannot_take_the_run() -> None:
    """The key's node down, excluded or full: the key's next eligible node."""
    routing = RoutingConfig(policy="affinity")
    pool, _, nodes = make_pool("a", "b", "c", routing=routing, max_runs={"a": 1, "b": 1, "c": 1})
    names = [s.client.name for s in nodes]
    first, second, third = affinity.order("k", names)
    assert pool.pick("m", affinity_key=SessionKey("k"), exclude=[nodes[first]]) is nodes[second]
    nodes[first].in_flight = 1
    assert pool.pick("m", affinity_key=SessionKey("k")) is nodes[second]
    pool.mark_down(nodes[second], "refused")
    assert pool.pick("m", affinity_key=SessionKey("k")) is nodes[third]


def test_least_loaded_policy_ignores_the_key() -> None:
    """The default policy: the key changes nothing."""
    pool, _, (a, b) = make_pool("a", "b")
    b.in_flight = 1
    assert {id(pool.pick("m", affinity_key=SessionKey(f"k{i}"))) for i in range(20)} == {id(a)}


def test_on_available_when_a_node_comes_up_or_its_cap_rises() -> None:
    """The admission queue is woken when a node comes up, or reports a higher max_runs."""
    pool, _, (a,) = make_pool("a", describe_max_runs=2)
    calls: list[str] = []
    pool.on_available = lambda: calls.append("x")
    pool.feed.described(a, NodeDescription("a", MODELS, max_runs=2))
    assert calls == []
    pool.feed.described(a, NodeDescription("a", MODELS, max_runs=4))
    assert calls == ["x"]
    pool.mark_down(a, "refused")
    pool.feed.described(a, NodeDescription("a", MODELS, max_runs=4))
    assert calls == ["x", "x"]


def test_the_breaker_counts_only_the_nodes_failures_of_its_current_life() -> None:
    """The edge's own deadline is no node fault (under load every node times out alike),
    and a run that started before the node last came up failed on the process that died:
    neither counts towards the breaker."""
    # The verdicts the run side gives the breaker (`report`): never the edge's deadline.
    assert {v for v in Verdict if v.counts_on_breaker} == {
        Verdict.ACCEPT_TIMEOUT, Verdict.START_FAILED, Verdict.STREAM_BROKEN, Verdict.ERROR_EVENT,
    }  # fmt: skip
    routing = RoutingConfig(breaker_failures=2, breaker_cooldown_s=5.0)
    pool, clock, (a,) = make_pool("a", routing=routing)
    before = clock.now
    pool.mark_down(a, "connection refused")
    clock.now += 1.0
    pool.feed.described(a, NodeDescription("a", MODELS))  # up again: a new process
    for _ in range(5):
        pool.run_failed(a, "stream_broken", started_at=before)
    assert pool.state_of(a) == "up"
    pool.run_failed(a, "stream_broken", started_at=clock.now)
    pool.run_failed(a, "error_event", started_at=clock.now)
    assert pool.state_of(a) == "open"


# --- why no node is available ---------------------------------------------------------------


def _unavailable(pool: NodePool, model: str, **pick: object) -> str:
    with pytest.raises(NodeUnavailableError) as raised:
        pool.pick(model, **pick)  # type: ignore[arg-type]
    return raised.value.message


def test_the_503_says_why_no_node_could_take_the_model() -> None:
    """The 503's message names, node by node, why none took the run: down and the reason it
    gave, the breaker open and for how long yet, tried already, up without the model."""
    routing = RoutingConfig(breaker_failures=2, breaker_cooldown_s=5.0)
    pool, clock, (a, b, c, d) = make_pool("a", "b", "c", "d", routing=routing)
    pool.feed.described(d, NodeDescription("d", ("other",)))
    pool.mark_down(a, "node a is unavailable: upstream http://127.0.0.1:9/v1 unreachable")
    for _ in range(2):
        pool.run_failed(b, "error_event")
    clock.now += 1.5
    words = _unavailable(pool, "m", exclude=[c])
    assert words == (
        "no node is available for model 'm': node 'a' is down (node a is unavailable:"
        " upstream http://127.0.0.1:9/v1 unreachable); node 'b' has its circuit breaker open"
        " for 3.5s more (after 2 failed run(s) in a row); already tried by this request:"
        " node 'c'; up but not serving it: node 'd'; retry later"
    )
    clock.now += 3.5
    assert pool.pick("m", exclude=[c]) is b  # half-open: the probe
    assert "half-open, its one probe run under way (another probe in 5.0s at most" in (
        _unavailable(pool, "m", exclude=[c])
    )


def test_the_503_for_a_model_no_node_up_serves() -> None:
    """A model no node up serves, while a node is down (it may serve it): 503, saying the
    node is down and why, and which nodes up serve other models; with logprobs asked,
    the nodes serving it without them are named."""
    pool, _, (a, b) = make_pool("a", "b", logprobs=("other",))
    pool.feed.described(b, NodeDescription("b", ("other",)))
    assert a.health.describe_failed(0.0, "x") is False  # suspect first
    a.health.describe_failed(0.0, "node a is unreachable: [Errno 111] Connect call failed")
    words = _unavailable(pool, "qwen3-8b")
    assert words == (
        "no node is available for model 'qwen3-8b': node 'a' is down (node a is unreachable:"
        " [Errno 111] Connect call failed); up but not serving it: node 'b'; retry later"
    )
    pool, _, (a, b) = make_pool("a", "b", logprobs=("m",))
    pool.feed.described(b, NodeDescription("b", ("m",)))  # b: m, without logprobs
    assert _unavailable(pool, "m", logprobs=True, exclude=[a]) == (
        "no node is available for model 'm': already tried by this request: node 'a';"
        " serving it without logprobs: node 'b'; retry later"
    )


def test_the_503_is_bounded_whatever_the_fleet() -> None:
    """A hundred nodes down with long reasons and long names: three named per group, the
    rest counted, each name and reason clipped; the message stays short."""
    names = [f"node-{i:03d}-" + "x" * 200 for i in range(100)]
    pool, _, nodes = make_pool(*names)
    for state in nodes:
        pool.mark_down(state, "upstream unreachable: " + "y" * 5000)
    words = _unavailable(pool, "qwen3-8b")  # none up serves it: no panic routing
    assert "and 97 more" in words
    assert words.count("is down") == 3
    assert len(words) < 1500, len(words)
