"""Routing by a node's own load (edge.fleet.load, and the pool's pick on it).

`rank` is checked as a pure function (hypothesis: the order it gives, whatever
the numbers); the pool's pick is driven by Watch reports given to it as its
watch task would (`NodeFeed.reported`), with runs taken as the admission queue takes
them. No node is contacted.
"""

from __future__ import annotations

import math

import trio
from hypothesis import given
from hypothesis import strategies as st

from edge.fleet import readiness
from edge.fleet.load import NodeLoad, rank, runs
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.node.client import NodeDescription
from tests.unit.test_pool import MODELS, make_pool

counts = st.integers(0, 10_000)
usage = st.floats(0.0, 1.0)
caps = st.one_of(st.just(math.inf), st.integers(1, 10_000).map(float))


def report(
    pool: NodePool,
    state: NodeState,
    *,
    active: int = 0,
    waiting: int | None = None,
    max_runs: int = 0,
    kv: tuple[int, int] | None = None,
) -> None:
    """A Watch report of `state`'s node, as its watch task hands it to the pool."""
    pool.feed.reported(
        state,
        NodeDescription(
            state.client.name, MODELS, active_runs=active, max_runs=max_runs,
            waiting_runs=waiting, kv_cache_tokens=kv[0] if kv else None,
            kv_cache_used_tokens=kv[1] if kv else None, heartbeat_ms=2000, seq=1,
        ),
    )  # fmt: skip


def take(pool: NodePool, model: str = "m") -> NodeState:
    """Pick a node and take its slot, as the admission queue does."""
    state = pool.pick(model)
    assert state is not None
    state.in_flight += 1
    return state


# --- rank, pure ------------------------------------------------------------------------------


@given(in_flight=counts, cap=caps)
def test_without_a_report_the_rank_is_the_processs_own_runs_over_its_cap(
    in_flight: int, cap: float
) -> None:
    """A node that reports nothing ranks as before Watch: this process's runs in flight
    on it, over the edge's cap when there is one."""
    expected = in_flight / cap if cap != math.inf else in_flight
    assert rank(None, in_flight, 0, cap) == (0.0, None, expected)
    assert runs(None, in_flight, 0) == in_flight


@given(a=st.tuples(counts, counts, usage), b=st.tuples(counts, counts, usage), max_runs=counts)
def test_the_queue_ranks_first_then_the_kv_cache_then_the_runs(
    a: tuple[int, int, float], b: tuple[int, int, float], max_runs: int
) -> None:
    """Right at a report (no run of this process started or ended since), nodes are
    ordered by their queue; on equal queues by KV cache in use; then by runs in flight
    over their cap."""
    (wa, aa, ka), (wb, ab, kb) = a, b
    if max_runs:
        aa, ab = min(aa, max_runs), min(ab, max_runs)
    ra = rank(NodeLoad(active=aa, waiting=wa, max_runs=max_runs, kv_usage=ka), 0, 0, math.inf)
    rb = rank(NodeLoad(active=ab, waiting=wb, max_runs=max_runs, kv_usage=kb), 0, 0, math.inf)
    if wa != wb:
        assert (ra < rb) == (wa < wb)
    elif ka != kb:
        assert (ra < rb) == (ka < kb)
    elif aa != ab:
        assert (ra < rb) == (aa < ab)
    else:
        assert ra == rb


@given(active=counts, waiting=counts, max_runs=counts, kv=usage, started=st.integers(0, 500))
def test_each_run_started_since_the_report_makes_the_node_no_lighter(
    active: int, waiting: int, max_runs: int, kv: float, started: int
) -> None:
    """Runs of this process started on the node since its report add to its numbers: its
    rank never drops as they start, and the ones past its max_runs count as waiting."""
    if max_runs:
        active = min(active, max_runs)
    load = NodeLoad(active=active, waiting=waiting, max_runs=max_runs, kv_usage=kv)
    ranks = [rank(load, 3 + k, 3, math.inf) for k in range(0, started + 1, max(1, started // 8))]
    assert ranks == sorted(ranks)
    last = rank(load, 3 + started, 3, math.inf)
    if max_runs:
        assert last[0] == waiting + max(0, active + started - max_runs)
    assert runs(load, 3 + started, 3) == active + waiting + started


@given(active=counts, ended=counts)
def test_runs_that_ended_since_the_report_are_taken_off_never_below_zero(
    active: int, ended: int
) -> None:
    """This process's runs that ended since the report leave the node's number (the node
    counted them), down to 0 and no lower."""
    load = NodeLoad(active=active)
    assert rank(load, 0, ended, math.inf)[2] == max(0, active - ended)
    assert runs(load, 0, ended) == max(0, active - ended)


# --- the pool's pick on reports --------------------------------------------------------------


def test_a_node_with_a_queue_is_passed_over_for_one_busier_without() -> None:
    """Node a waits on 2 runs with 3 in flight; b has 7 in flight and no queue: b."""
    pool, _, (a, b) = make_pool("a", "b")
    report(pool, a, active=3, waiting=2, max_runs=3)
    report(pool, b, active=7, waiting=0, max_runs=8)
    assert pool.pick("m") is b


def test_the_kv_cache_decides_between_equal_queues() -> None:
    """No queue on either; a's KV cache is 90 % used, b's 10 %: b, though b runs more."""
    pool, _, (a, b) = make_pool("a", "b")
    report(pool, a, active=1, kv=(1000, 900))
    report(pool, b, active=5, kv=(1000, 100))
    assert pool.pick("m") is b


def test_runs_between_two_reports_count_and_a_report_counts_them_again() -> None:
    """a reports 4 runs, b 0 (each of 8): this process's next runs go to b until b, with
    them, reaches a (4 runs), then alternate; b's next report (its real runs) replaces
    the count: this process's runs since are counted from there."""
    pool, _, (a, b) = make_pool("a", "b")
    report(pool, a, active=4, max_runs=8)
    report(pool, b, active=0, max_runs=8)
    assert [take(pool).client.name for _ in range(4)] == ["b"] * 4
    # b at 4 (0 + 4 of ours) ties a: the next two go one to each.
    assert {take(pool).client.name, take(pool).client.name} == {"a", "b"}
    report(pool, b, active=5, max_runs=8)  # b counted our 5
    report(pool, a, active=6, max_runs=8)  # a counted our 1 (and has one more)
    assert take(pool) is b
    b.in_flight -= 3  # three of our runs on b ended since its report
    assert take(pool) is b
    assert b.rank() == (0.0, None, 4 / 8)


def test_a_run_waits_for_a_node_full_here_rather_than_join_a_queue() -> None:
    """a has 10 runs waiting in its queue; b, no queue, has its 2 places taken by this
    process: no pick (the run waits here for b), until one of b's runs ends. Without a
    node full here, a queue is no bar: a node with a queue is still picked when it is
    the only one with a slot."""
    pool, _, (a, b) = make_pool("a", "b")
    report(pool, a, active=2, waiting=10, max_runs=2)
    report(pool, b, active=0, max_runs=2)
    assert [take(pool).client.name for _ in range(2)] == ["b", "b"]
    assert pool.pick("m") is None
    b.in_flight -= 1
    assert pool.pick("m") is b
    pool.nodes.remove(b)
    assert pool.pick("m") is a


def test_a_node_without_reports_is_ranked_by_this_processs_runs() -> None:
    """Reported and unreported nodes side by side: the unreported one by its runs in
    flight here over its cap (here 0: it is picked over a reported node with runs)."""
    pool, _, (a, b) = make_pool("a", "b")
    report(pool, a, active=2)
    assert b.load is None
    assert pool.pick("m") is b


def test_the_edges_own_cap_still_bounds_a_reported_node() -> None:
    """The node reports room for 100 runs; [[nodes]] max_runs = 1 and one run in flight:
    no slot, whatever the report says."""
    pool, _, (a,) = make_pool("a", max_runs={"a": 1})
    report(pool, a, active=0, max_runs=100)
    take(pool)
    assert pool.pick("m") is None


def test_a_report_gives_the_load_gauges_and_status() -> None:
    """The gauges' values and /readyz's node entry carry the reported load."""
    pool, _, (a,) = make_pool("a")
    assert readiness.load_values(a) == (0.0, 0.0, None, True)
    report(pool, a, active=3, waiting=1, kv=(200, 50))
    assert readiness.load_values(a) == (1, 3, 0.25, True)
    (entry,) = readiness.status(pool)
    assert entry["watched"] is True
    assert entry["load"] == {"active_runs": 3, "waiting_runs": 1, "kv_cache_usage": 0.25}
    a.polled = True
    a.load = None
    assert readiness.load_values(a) == (0.0, 0.0, None, False)


def test_a_node_that_says_no_kv_figure_is_unknown_not_empty() -> None:
    """llama.cpp exposes no KV figure: its node's /readyz entry says null and its gauge
    value is None (no series), and it is not preferred as an empty cache over a node
    that says its cache is full: among the two the KV cache decides nothing, the runs
    in flight do."""
    pool, _, (a, b) = make_pool("a", "b")
    report(pool, a, active=1)
    report(pool, b, active=0, kv=(100, 95))
    assert readiness.load_values(a) == (0, 1, None, True)
    entry = next(e for e in readiness.status(pool) if e["name"] == "a")
    assert entry["load"]["kv_cache_usage"] is None
    assert pool.pick("m") is b
    report(pool, b, active=2, kv=(100, 0))
    assert pool.pick("m") is a


async def test_a_refused_run_ends_the_watched_nodes_subscription() -> None:
    """mark_down on a watched node cancels its open subscription (it is subscribed to again
    as a down node is probed)."""
    pool, _, (a,) = make_pool("a")
    with trio.CancelScope() as scope:
        a.watch_scope = scope
        pool.mark_down(a, "connection refused")
        assert scope.cancel_called
        await trio.lowlevel.checkpoint()
    assert pool.state_of(a) == "down"
