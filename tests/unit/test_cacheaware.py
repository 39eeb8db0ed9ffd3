"""The cache-aware policy (edge.fleet.cacheaware) through the pool's pick: hits, misses
by rendezvous, the load bound, sessions, the correction by usage and the exact index
fed by a node's Watch reports.

Pools are driven as in tests/unit/test_pool.py: Describe answers and Watch reports
handed to them as their tasks would, runs taken as the admission queue takes them.
No node is contacted.
"""

from __future__ import annotations

from array import array
from dataclasses import replace
from typing import get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.config import RoutingConfig
from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import BLOCK_TOKENS, MAX_KV_BLOCKS_PER_REPORT
from edge.errors import NodeFailedError
from edge.fleet import affinity, cacheaware, cacheindex, readiness
from edge.fleet.affinity import SessionKey
from edge.fleet.cacheaware import Route
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.node.client import NodeDescription
from edge.node.describe import description_from_pb
from edge.observe.metrics import CACHE_ROUTING_OUTCOMES
from edge.stream.events import Usage
from tests.unit.test_pool import MODELS, make_pool

# The bounds' arithmetic in these tests is the affinity policy's 1.25 x mean + 1 (the
# configuration's default is looser, 2: the bound is a knob; its rule is the same).
CACHE_AWARE = RoutingConfig(policy="cache_aware", cache_load_factor=1.25)


def blocks(start: int, n: int) -> array[int]:
    return array("Q", range(start, start + n))


def take(pool: NodePool, route: Route | None, key: SessionKey | None = None) -> NodeState:
    """Pick a node for `route` and take its slot, as the admission queue does."""
    state = pool.pick("m", route=route, affinity_key=key)
    assert state is not None
    state.in_flight += 1
    return state


def kv_report(
    pool: NodePool,
    state: NodeState,
    *,
    seq: int,
    stored: array[int] | None = None,
    evicted: array[int] | None = None,
    snapshot: bool = False,
    active: int = 0,
) -> None:
    """A Watch report carrying KV block events, as the watch task hands it to the pool."""
    pool.feed.reported(
        state,
        NodeDescription(
            state.client.name, MODELS, active_runs=active, heartbeat_ms=2000, seq=seq,
            kv_cache_tokens=1_000 * BLOCK_TOKENS,
            kv_stored=stored if stored is not None else array("Q"),
            kv_evicted=evicted if evicted is not None else array("Q"),
            kv_snapshot=snapshot,
        ),
    )  # fmt: skip


def test_the_outcomes_are_the_metrics_labels() -> None:
    """Every way the policy chooses is a label of iop_edge_cache_routing_total."""
    assert get_args(cacheaware.Outcome) == CACHE_ROUTING_OUTCOMES == cacheaware.OUTCOMES


def test_a_new_prefix_goes_where_rendezvous_says_then_stays_there() -> None:
    """A miss goes to the first block's rendezvous node (not the first listed or least
    loaded); the next request of that prefix, longer, is a hit there."""
    pool, _, nodes = make_pool("a", "b", "c", routing=CACHE_AWARE)
    seen: list[tuple[str, str, int]] = []
    pool.picker.on_routed = lambda outcome, node, tokens: seen.append((outcome, node, tokens))
    first = blocks(7, 3)
    expected = affinity.order(cacheaware.rendezvous_key(7), ["a", "b", "c"])[0]
    chosen = take(pool, Route(first))
    assert chosen is nodes[expected]
    route = Route(blocks(7, 5))
    assert take(pool, route) is chosen
    assert route.predicted == 3
    assert seen == [("miss", chosen.client.name, 0), ("hit", chosen.client.name, 3 * BLOCK_TOKENS)]


def test_a_new_prefix_goes_to_the_first_node_in_its_order_with_room() -> None:
    """A miss skips a node in its rendezvous order whose cache is full of blocks sent it
    lately (placing the prefix there would evict one in use): the first one with room
    for it takes it. When none has room, the first in order does, as plain rendezvous."""
    pool, _, nodes = make_pool("a", "b", "c", routing=replace(CACHE_AWARE, cache_blocks=10))
    order = affinity.order(cacheaware.rendezvous_key(7), ["a", "b", "c"])
    nodes[order[0]].cache.routed(blocks(100, 8), 0)  # 8 of 10 blocks: no room for 3 more
    chosen = take(pool, Route(blocks(7, 3)))
    chosen.in_flight -= 1
    assert chosen is nodes[order[1]]
    for node in nodes:
        node.cache.routed(blocks(200 + 20 * nodes.index(node), 10), 0)  # every one full
    chosen = take(pool, Route(blocks(9, 3)))
    assert chosen is nodes[affinity.order(cacheaware.rendezvous_key(9), ["a", "b", "c"])[0]]


# The hot-spot guard off: a node's share of the dispatches does not move a prefix.
UNSHARED = replace(CACHE_AWARE, cache_share_factor=1_000.0)


def _order(prefix: array[int], names: list[str]) -> list[int]:
    """The rendezvous order of a new prefix's key block over `names`."""
    key = cacheaware.key_block(prefix, CACHE_AWARE.cache_threshold)
    return affinity.order(cacheaware.rendezvous_key(key), names)


def _first_on(node: int, names: list[str], n: int, start: int) -> array[int]:
    """A new prefix of `n` blocks, from `start` on, whose order starts with `node`."""
    return next(
        p for s in range(start, start + 100_000, n) if _order(p := blocks(s, n), names)[0] == node
    )


def _pinned_to(node: int, names: list[str]) -> SessionKey:
    """A named session whose node is `node` (its rendezvous order's first)."""
    key = next(f"s{n}" for n in range(10_000) if affinity.order(f"s{n}", names)[0] == node)
    return SessionKey(key, named=True)


def test_a_node_whose_traffic_fills_its_cache_takes_no_new_prefix_until_it_expires() -> None:
    """Exact indexes, every node's cache full (as a warm paged cache always is): a new
    prefix goes to the first node in its order whose live demand (what this edge sent it
    over the last LIVE_WINDOW dispatches) leaves room for it, not to the first in order
    while its recent traffic fills its cache; once that traffic is older than the window,
    the first in order takes new prefixes again."""
    pool, _, nodes = make_pool("a", "b", "c", routing=UNSHARED)
    names = [s.client.name for s in nodes]
    for seq, state in enumerate(nodes, 1):  # 1,000 blocks each, all held
        kv_report(pool, state, seq=seq, snapshot=True, stored=blocks(10_000 * seq, 1_000))
    first = 0
    new, later = _first_on(first, names, 300, 50_000), _first_on(first, names, 300, 500_000)
    assert take(pool, Route(new)) is nodes[first]  # full, but of blocks not in use
    nodes[first].in_flight = 0
    session = _pinned_to(first, names)
    for k in range(3):  # with `new`, 1,200 blocks sent lately for 1,000
        assert take(pool, Route(blocks(100_000 + 1_000 * k, 300)), session) is nodes[first]
        nodes[first].in_flight = 0
    assert take(pool, Route(later)) is nodes[_order(later, names)[1]]
    for k in range(cacheindex.LIVE_WINDOW):  # other traffic, elsewhere
        take(pool, Route(blocks(200_000 + 10 * k, 1))).in_flight = 0
    assert take(pool, Route(_first_on(first, names, 300, 900_000))) is nodes[first]


def test_a_prefix_evicted_by_an_over_subscribed_node_moves_to_the_next_with_room() -> None:
    """A prefix placed on a node, then evicted there while the node's live demand
    outgrew its cache, is placed on the next node in its order with room, not sent back
    to be evicted again."""
    pool, _, nodes = make_pool("a", "b", "c", routing=UNSHARED)
    names = [s.client.name for s in nodes]
    for state in nodes:
        kv_report(pool, state, seq=1, snapshot=True)  # exact, empty; 1,000 blocks each
    first = 0
    prefix = _first_on(first, names, 300, 40)
    assert take(pool, Route(prefix)) is nodes[first]
    nodes[first].in_flight = 0
    kv_report(pool, nodes[first], seq=2, stored=prefix)
    session = _pinned_to(first, names)
    for k in range(3):  # more traffic pinned to `first` than its cache holds
        assert take(pool, Route(blocks(100_000 + 1_000 * k, 300)), session) is nodes[first]
        nodes[first].in_flight = 0
    kv_report(pool, nodes[first], seq=3, evicted=prefix)
    assert take(pool, Route(prefix)) is nodes[_order(prefix, names)[1]]


def test_what_a_node_reports_storing_counts_in_every_edges_live_demand() -> None:
    """Two edges over the same exact nodes: the prefixes one edge placed on a node, once
    the node reports storing them, fill that node's live demand for the other edge too,
    which then places a new prefix as the first would, on the next node with room."""
    one, _, nodes_one = make_pool("a", "b", "c", routing=UNSHARED)
    two, _, nodes_two = make_pool("a", "b", "c", routing=UNSHARED)
    names = [s.client.name for s in nodes_one]
    for pool, nodes in ((one, nodes_one), (two, nodes_two)):
        for state in nodes:
            kv_report(pool, state, seq=1, snapshot=True)  # exact, empty; 1,000 blocks each
    first = 0
    session = _pinned_to(first, names)
    stored = array("Q")
    for k in range(3):  # 900 blocks of `first`'s 1,000, placed by the first edge
        prefix = blocks(100_000 + 1_000 * k, 300)
        assert take(one, Route(prefix), session) is nodes_one[first]
        nodes_one[first].in_flight = 0
        stored.extend(prefix)
    new = _first_on(first, names, 300, 50_000)
    assert take(two, Route(new)) is nodes_two[first]  # before the node's report
    nodes_two[first].in_flight = 0
    kv_report(one, nodes_one[first], seq=2, stored=stored)
    kv_report(two, nodes_two[first], seq=2, stored=stored)
    later = _first_on(first, names, 300, 500_000)
    assert take(one, Route(later)) is nodes_one[_order(later, names)[1]]
    assert take(two, Route(later)) is nodes_two[_order(later, names)[1]]


def test_readyz_shows_each_nodes_cache_as_the_policy_sees_it() -> None:
    """Under cache_aware, each node's /readyz entry says whether its index is exact, its
    capacity, what the index holds and its live demand, in blocks; the live demand goes
    once the window passes. Under another policy, no such entry."""
    pool, _, (a, _b) = make_pool("a", "b", routing=UNSHARED)
    kv_report(pool, a, seq=1, snapshot=True, stored=blocks(900, 5))
    session = _pinned_to(0, ["a", "b"])
    assert take(pool, Route(blocks(10, 7)), session) is a
    a.in_flight = 0
    entries = {entry["name"]: entry for entry in readiness.status(pool)}
    assert entries["a"]["cache"] == {
        "index": "exact", "capacity_blocks": 1_000, "held_blocks": 5, "live_blocks": 7,
    }  # fmt: skip
    assert entries["b"]["cache"] == {
        "index": "approximate", "capacity_blocks": CACHE_AWARE.cache_blocks,
        "held_blocks": 0, "live_blocks": 0,
    }  # fmt: skip
    to_b = _pinned_to(1, ["a", "b"])
    for k in range(cacheindex.LIVE_WINDOW):
        take(pool, Route(blocks(2_000 + 10 * k, 1)), to_b).in_flight = 0
    live = {e["name"]: e["cache"]["live_blocks"] for e in readiness.status(pool)}
    assert live == {"a": 0, "b": 64}
    plain, _, _ = make_pool("a")
    assert "cache" not in readiness.status(plain)[0]


def test_a_new_prefix_goes_to_the_emptier_of_two_nodes_when_the_indexes_are_approximate() -> None:
    """Two choices, with approximate indexes: of the first two nodes in the prefix's
    rendezvous order with room, the one whose index holds fewer blocks takes it; the
    third, emptier still, is not asked. With exact indexes, the first with room."""
    pool, _, nodes = make_pool("a", "b", "c", routing=replace(CACHE_AWARE, cache_blocks=100))
    order = affinity.order(cacheaware.rendezvous_key(7), ["a", "b", "c"])
    nodes[order[0]].cache.routed(blocks(100, 6), 0)
    nodes[order[1]].cache.routed(blocks(200, 4), 0)
    assert take(pool, Route(blocks(7, 3))) is nodes[order[1]]
    # Exact indexes (the nodes' own KV events): the first in order with room, always.
    pool, _, nodes = make_pool("a", "b", "c", routing=replace(CACHE_AWARE, cache_blocks=100))
    nodes[order[0]].cache.snapshot(blocks(100, 6))
    nodes[order[1]].cache.snapshot(blocks(200, 4))
    assert take(pool, Route(blocks(7, 3))) is nodes[order[0]]


def test_two_edges_send_a_new_prefix_to_the_same_node() -> None:
    """Two pools (two edges) over the same nodes, listed in another order, knowing
    nothing of each other: each sends a new prefix to the same node."""
    one, _, _ = make_pool("a", "b", "c", "d", routing=CACHE_AWARE)
    two, _, _ = make_pool("d", "b", "a", "c", routing=CACHE_AWARE)
    for start in range(0, 400, 10):
        route = blocks(start, 4)
        assert take(one, Route(route)).client.name == take(two, Route(route)).client.name
        for pool in (one, two):
            for state in pool.nodes:
                state.in_flight = 0


def test_the_load_bound_passes_a_hot_prefix_on_and_it_spreads() -> None:
    """A node holding the prefix but past 1.25 x mean + 1 runs is passed over (outcome
    load_bound); the next node then holds the prefix too, and takes it while the first
    is busy: a hot prefix spreads as its load needs."""
    pool, _, nodes = make_pool("a", "b", "c", routing=CACHE_AWARE)
    hot = blocks(1, 6)
    home = take(pool, Route(hot))
    seen: list[str] = []
    pool.picker.on_routed = lambda outcome, node, tokens: seen.append(outcome)
    assert take(pool, Route(hot)) is home  # runs (1, 0, 0): the bound is 1.42
    assert home.in_flight == 2  # runs (2, 0, 0): the bound is 1.83
    overflow = take(pool, Route(hot))
    assert overflow is not home
    assert seen[-1] == "load_bound"
    home.in_flight = 0
    for state in nodes:
        if state is not home:
            state.in_flight = 0
    # Both hold the prefix now: the less loaded of the two takes it.
    home.in_flight = 2
    assert take(pool, Route(hot)) is overflow
    assert seen[-1] == "hit"


@given(st.lists(st.integers(0, 5), min_size=2, max_size=6), st.integers(0, 10_000))
def test_no_node_past_the_bound_is_chosen_for_its_cache(loads: list[int], start: int) -> None:
    """Whatever the loads and whoever holds the prefix, the node chosen has at most
    1.25 x the mean runs + 1."""
    names = [f"n{i}" for i in range(len(loads))]
    pool, _, nodes = make_pool(*names, routing=CACHE_AWARE)
    prefix = blocks(start, 4)
    for state, runs in zip(nodes, loads, strict=True):
        state.cache.routed(prefix[: runs % 5], 0)
        state.in_flight = runs
    chosen = pool.pick("m", route=Route(prefix))
    assert chosen is not None
    assert chosen.in_flight <= 1.25 * sum(loads) / len(loads) + 1


def test_a_session_key_pins_the_session() -> None:
    """With a named session (X-Session-Id), the session's node as the affinity policy
    picks it, whatever another node holds; its blocks are recorded there."""
    pool, _, nodes = make_pool("a", "b", "c", routing=CACHE_AWARE)
    prefix = blocks(0, 4)
    for state in nodes:
        state.cache.routed(prefix, 0)
    other = blocks(50, 4)
    pinned = nodes[affinity.order("session-1", ["a", "b", "c"])[0]]
    for state in nodes:
        if state is not pinned:
            state.cache.routed(other, 0)
    assert take(pool, Route(other), key=SessionKey("session-1")) is pinned
    assert pinned.cache.longest(other) == 4


def test_a_user_alone_does_not_pin_a_request_to_a_node() -> None:
    """A `user` names a person, not a conversation: under cache_aware a request whose key
    is only its `user` goes where its prefix is held, not to the user's node; the same
    key named as a session (X-Session-Id, prompt_cache_key) pins it."""
    pool, _, nodes = make_pool("a", "b", "c", routing=CACHE_AWARE)
    prefix = blocks(0, 4)
    users_node = nodes[affinity.order("user-7", ["a", "b", "c"])[0]]
    holder = next(state for state in nodes if state is not users_node)
    holder.cache.routed(prefix, 0)
    assert take(pool, Route(prefix), key=SessionKey("user-7", named=False)) is holder
    assert take(pool, Route(prefix), key=SessionKey("user-7")) is users_node


def test_a_prompt_under_one_block_goes_to_the_least_loaded() -> None:
    """No block, nothing to reuse: the least loaded node, as least_loaded picks it."""
    pool, _, (a, b) = make_pool("a", "b", routing=CACHE_AWARE)
    a.in_flight = 1
    assert pool.pick("m", route=Route(array("Q"))) is b
    assert pool.pick("m") is b  # no route at all: likewise


def test_cached_input_tokens_under_the_prediction_correct_the_index() -> None:
    """A run whose usage says fewer cached tokens than predicted: its blocks past them
    are dropped from its node's index, so the next request of that prefix is
    predicted what the node really had; as many as predicted changes nothing."""
    pool, _, _ = make_pool("a", "b", routing=CACHE_AWARE)
    prefix = blocks(3, 8)
    node = take(pool, Route(prefix))
    route = Route(prefix)
    assert take(pool, route) is node
    assert route.predicted == 8
    pool.run_usage(node, prefix, 8, Usage(100, 1, cached_input_tokens=8 * BLOCK_TOKENS))
    assert node.cache.longest(prefix) == 8
    pool.run_usage(node, prefix, 8, Usage(100, 1, cached_input_tokens=3 * BLOCK_TOKENS + 10))
    assert node.cache.longest(prefix) == 3


def test_a_nodes_eviction_report_changes_the_next_pick() -> None:
    """An exact node (KV events on its Watch reports) holding a prefix gets it; once it
    reports the blocks evicted, the prefix is a miss again, placed by rendezvous; a
    snapshot replaces what routing recorded."""
    pool, _, nodes = make_pool("a", "b", "c", routing=CACHE_AWARE)
    prefix = blocks(40, 6)
    key = cacheaware.key_block(prefix, CACHE_AWARE.cache_threshold)
    home = nodes[affinity.order(cacheaware.rendezvous_key(key), ["a", "b", "c"])[0]]
    holder = next(s for s in nodes if s is not home)
    for seq, state in enumerate(nodes, 1):
        kv_report(pool, state, seq=1, snapshot=True, stored=prefix if state is holder else None)
        assert state.cache.exact, seq
    assert pool.pick("m", route=Route(prefix)) is holder
    kv_report(pool, holder, seq=2, evicted=prefix[2:])
    route = Route(prefix)
    assert pool.pick("m", route=route) is holder
    assert route.predicted == 2
    kv_report(pool, holder, seq=3, evicted=prefix[:2])
    assert pool.pick("m", route=Route(prefix)) is home
    # Routing records nothing on an exact node: only its reports do.
    assert home.cache.longest(prefix) == 0
    kv_report(pool, home, seq=2, stored=prefix)
    assert pool.pick("m", route=Route(prefix)) is home


def test_a_new_stream_without_a_snapshot_makes_the_index_approximate_again() -> None:
    """A node whose new Watch stream's first report has no snapshot no longer tracks its
    blocks: its index is emptied and fed by routing again."""
    pool, _, (a,) = make_pool("a", routing=CACHE_AWARE)
    kv_report(pool, a, seq=1, snapshot=True, stored=blocks(0, 3))
    kv_report(pool, a, seq=1)
    assert not a.cache.exact
    assert len(a.cache) == 0
    take(pool, Route(blocks(0, 3)))
    assert a.cache.longest(blocks(0, 3)) == 3


def test_the_capacity_follows_the_nodes_report_else_the_knob() -> None:
    """A node's index holds its reported kv_cache_tokens // BLOCK_TOKENS blocks; one
    that does not say, [routing] cache_blocks."""
    routing = RoutingConfig(policy="cache_aware", cache_blocks=7)
    pool, _, (a,) = make_pool("a", routing=routing)
    assert a.cache.capacity == 7
    kv_report(pool, a, seq=1)
    assert a.cache.capacity == 1_000
    take(pool, Route(blocks(0, 5000)))
    assert len(a.cache) == 1_000


def test_a_report_with_too_many_kv_events_is_refused_whole() -> None:
    """A node is not trusted: more than MAX_KV_BLOCKS_PER_REPORT block hashes in one
    report is the node's failure, not an index that grows."""
    half = MAX_KV_BLOCKS_PER_REPORT // 2
    fine = pb.DescribeResponse(
        kv_blocks_stored=list(range(half)), kv_blocks_evicted=list(range(half))
    )
    described = description_from_pb(fine, "n", "addr")
    assert len(described.kv_stored) == half
    assert not described.kv_snapshot
    over = pb.DescribeResponse(kv_blocks_stored=list(range(MAX_KV_BLOCKS_PER_REPORT + 1)))
    with pytest.raises(NodeFailedError, match="KV block events"):
        description_from_pb(over, "n", "addr")


def test_other_policies_keep_no_index() -> None:
    """Under least_loaded the route changes nothing and nothing is recorded."""
    pool, _, (a, b) = make_pool("a", "b")
    prefix = blocks(0, 4)
    b.cache.routed(prefix, 0)
    a.in_flight = 1
    assert pool.pick("m", route=Route(prefix)) is b  # the lighter, not the one holding it
    a.in_flight, b.in_flight = 0, 1
    assert pool.pick("m", route=Route(prefix)) is a
    assert len(a.cache) == 0


def test_short_runs_of_a_hot_prefix_spread_by_share() -> None:
    """Runs that end before the next starts never pass the load bound; the share bound
    passes a hot prefix on all the same: over 40 such runs of one prefix on 4 nodes no
    node's recent share passes 1.4 x the mean + 1 by more than the one run that took
    it past, and the nodes it spilled to then hold the prefix (hits there)."""
    pool, _, nodes = make_pool("a", "b", "c", "d", routing=CACHE_AWARE)
    outcomes: list[str] = []
    pool.picker.on_routed = lambda outcome, node, tokens: outcomes.append(outcome)
    hot = blocks(1, 6)
    counts = {state.client.name: 0 for state in nodes}
    for _ in range(40):
        state = take(pool, Route(hot))
        state.in_flight -= 1  # over before the next one starts
        counts[state.client.name] += 1
        shares = [pool.picker.shares[s.client.name] for s in nodes]
        assert max(shares) <= 1.4 * sum(shares) / len(shares) + 2 + 1e-9
    assert sorted(counts.values())[-2] > 0  # spilled
    assert outcomes.count("hit") > 20  # and the nodes it spilled to hit


@given(
    st.integers(2, 6),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=150),
)
def test_a_node_past_the_share_bound_is_chosen_only_when_the_others_are_past_the_load_bound(
    count: int, picks: list[tuple[int, int]]
) -> None:
    """Whatever the sequence of picks for one prefix (each with whatever runs in flight
    on the nodes), a node past the share bound (1.4 x the candidates' mean recent share
    + 1) is chosen only when every other node is past the load bound (1.25 x their mean
    runs + 1): the load bound comes first, so with the others loaded the hot node takes
    the run. The node chosen is always within the load bound."""
    names = [f"n{i}" for i in range(count)]
    pool, _, nodes = make_pool(*names, routing=CACHE_AWARE)
    prefix = blocks(7, 4)
    for busy, held in picks:
        for i, state in enumerate(nodes):
            state.in_flight = busy if i == held % count else 0
        shares = [pool.picker.shares[name] for name in names]
        runs = [state.in_flight for state in nodes]
        share_bound = 1.4 * sum(shares) / count + 1
        load_bound = 1.25 * sum(runs) / count + 1
        chosen = pool.pick("m", route=Route(prefix))
        assert chosen is not None
        i = nodes.index(chosen)
        assert runs[i] <= load_bound
        if shares[i] > share_bound + 1e-9:
            assert all(runs[j] > load_bound for j in range(count) if j != i)


def test_the_share_knob_bounds_the_busiest_node() -> None:
    """[routing] cache_share_factor sets the share bound: a large factor leaves a hot
    prefix of short runs on its node."""
    routing = RoutingConfig(policy="cache_aware", cache_share_factor=100.0)
    pool, _, _nodes = make_pool("a", "b", "c", "d", routing=routing)
    hot = blocks(1, 6)
    seen = set()
    for _ in range(40):
        state = take(pool, Route(hot))
        state.in_flight -= 1
        seen.add(state.client.name)
    assert len(seen) == 1


def test_a_prefix_not_yet_reported_goes_where_it_was_placed() -> None:
    """With an exact index (the node's reports, not routing), a prefix's second request
    before its node reported storing it goes to the node its first went to, even when
    rendezvous now prefers another (that one's load past the bound)."""
    pool, _, nodes = make_pool("a", "b", "c", routing=CACHE_AWARE)
    for seq, state in enumerate(nodes, start=1):
        kv_report(pool, state, seq=seq, snapshot=True)  # exact, empty
    prefix = blocks(40, 5)
    names = [s.client.name for s in nodes]
    key = cacheaware.key_block(prefix, CACHE_AWARE.cache_threshold)
    first, second, _third = affinity.order(cacheaware.rendezvous_key(key), names)
    nodes[first].in_flight = 3  # past 1.25 x 1 + 1: the prefix is placed on `second`
    assert take(pool, Route(prefix)) is nodes[second]
    nodes[first].in_flight = 0
    nodes[second].in_flight = 0
    assert take(pool, Route(prefix)) is nodes[second]  # not back to `first`
    assert len(pool.picker.placements) == 1


def test_none_within_both_bounds_goes_to_the_lightest() -> None:
    """The lightest node past the share bound and the node of lowest share past the load
    bound: the run goes to a node within the load bound, the lightest."""
    pool, _, (a, b) = make_pool("a", "b", routing=CACHE_AWARE)
    prefix = blocks(3, 4)
    for _ in range(6):  # a's share grows past the bound while b is busy
        b.in_flight = 20
        state = take(pool, Route(blocks(100 + _ * 10, 2)))
        assert state is a
        a.in_flight = 0
    b.in_flight = 20
    assert take(pool, Route(prefix)) is a


def _conversation(k: int, turns: int = 1) -> array[int]:
    """Conversation k: a shared first block (a short system prompt), then its own nine
    blocks, and nine more for each later turn."""
    return array("Q", [7, *range(1000 * k + 1, 1000 * k + 1 + 9 * turns)])


@pytest.mark.parametrize("threshold", [0.3, 0.0])
def test_new_conversations_sharing_only_a_short_prefix_spread_over_the_nodes(
    threshold: float,
) -> None:
    """Conversations that share one block of ten (a system prompt) and nothing else: a
    weak prefix, under cache_threshold of the request's blocks. Each is placed as a
    miss by its key block, past the shared one, so they spread over all four nodes, and each
    one's next turn is a hit where it went. With the threshold at 0, the shared block
    decides: every one goes to the node that held it first (no bound is near)."""
    routing = replace(
        CACHE_AWARE, cache_threshold=threshold, cache_load_factor=100, cache_share_factor=100
    )
    pool, _, _ = make_pool("a", "b", "c", "d", routing=routing)
    first = take(pool, Route(_conversation(0)))
    first.in_flight -= 1
    went: dict[int, str] = {}
    for k in range(1, 40):
        state = take(pool, Route(_conversation(k)))
        state.in_flight -= 1  # it ended: the loads stay even
        went[k] = state.client.name
    if threshold:
        assert set(went.values()) == {"a", "b", "c", "d"}
        for k in (1, 5, 9):
            route = Route(_conversation(k, turns=2))
            again = take(pool, route)
            assert (again.client.name, route.predicted) == (went[k], 10)
    else:
        assert set(went.values()) == {first.client.name}


def test_new_conversations_placed_at_once_spread_before_any_node_reports_a_block() -> None:
    """Conversations sharing a short system prompt, all placed before any node reported
    holding anything (exact indexes, empty): each is placed by its own key block, so
    they spread over all four nodes (by the shared first block, they all had one key
    and went where the first went)."""
    pool, _, nodes = make_pool(
        "a",
        "b",
        "c",
        "d",
        routing=replace(CACHE_AWARE, cache_load_factor=100, cache_share_factor=100),
    )
    for seq, state in enumerate(nodes, start=1):
        kv_report(pool, state, seq=seq, snapshot=True)  # exact, empty
    went = set()
    for k in range(16):
        state = take(pool, Route(_conversation(k)))
        state.in_flight -= 1
        went.add(state.client.name)
    assert went == {"a", "b", "c", "d"}


def test_a_weak_prefix_is_placed_the_same_by_two_edges() -> None:
    """Two edges (nodes listed in another order) whose nodes hold the same blocks (exact
    indexes: every node reported the shared block) place a new conversation that shares
    only that weak prefix on the same node: the first in the rendezvous order of its key
    block, past the shared one."""
    names = ["a", "b", "c", "d"]
    keys = [cacheaware.key_block(_conversation(k), CACHE_AWARE.cache_threshold) for k in range(8)]
    assert 7 not in keys
    expected = [names[affinity.order(cacheaware.rendezvous_key(key), names)[0]] for key in keys]
    for listed in (names, ["d", "b", "a", "c"]):
        pool, _, _ = make_pool(*listed, routing=CACHE_AWARE)
        for state in pool.nodes:
            state.cache.snapshot(array("Q", [7]))
        picked = []
        for k in range(8):
            state = take(pool, Route(_conversation(k)))
            state.in_flight -= 1  # it ended: no bound is near
            picked.append(state.client.name)
        assert picked == expected
    assert len(set(expected)) > 1
