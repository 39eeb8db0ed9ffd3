"""The pool's nodes and settings changed while it runs (edge.fleet.pool: `add`, `remove`,
`configure`, `set_max_runs`), as a reload changes them. Pure bookkeeping: the states are
set as Describe answers would set them, on a clock the tests move."""

from __future__ import annotations

from typing import cast

import pytest

from edge.config import RoutingConfig
from edge.errors import NodeUnavailableError, NotFoundError
from edge.fleet.pool import NodePool
from edge.node.client import NodeClient, NodeDescription
from tests.unit.test_pool import MODELS, Clock, _Named


def _pool(*names: str, routing: RoutingConfig | None = None) -> NodePool:
    pool = NodePool([cast(NodeClient, _Named(n)) for n in names], routing=routing, clock=Clock())
    for state in pool.nodes:
        pool.feed.described(state, NodeDescription(state.client.name, MODELS))
    return pool


def test_a_node_added_takes_runs_once_it_answered() -> None:
    """A node added serves no model, so gets no run, until its first answer (a model only
    it may serve is "retry later" meanwhile, not unknown); then it does, and its answer
    says it was probed."""
    pool = _pool("a")
    added = pool.add(cast(NodeClient, _Named("b")))
    assert not added.probed.is_set()
    assert {pool.pick("m") for _ in range(4)} == {pool.nodes[0]}
    with pytest.raises(NodeUnavailableError):
        pool.pick("only-b")
    pool.feed.described(added, NodeDescription("b", ("only-b", *MODELS)))
    assert added.probed.is_set()
    assert pool.pick("only-b") is added


def test_a_node_removed_gets_no_new_run_and_keeps_its_runs() -> None:
    """A node removed is picked no more, even when the others are full or down; its runs
    in flight keep their slots (counted until they end)."""
    pool = _pool("a", "b")
    a, b = pool.nodes
    assert pool.pick("m") is a
    a.in_flight = 1
    pool.remove(a)
    assert a.retired
    assert pool.nodes == [b]
    assert {pool.pick("m") for _ in range(4)} == {b}
    assert a.in_flight == 1
    pool.mark_down(b, "refused")
    assert pool.pick("m") is b  # panic routing tries the only node left, never the removed one
    pool.remove(b)
    with pytest.raises(NotFoundError):
        pool.pick("m")


def test_new_routing_applies_to_the_nodes_that_stay() -> None:
    """`configure` switches the policy and the breaker's numbers for the next pick, on the
    same node objects (their breakers, loads and caches carry over)."""
    pool = _pool("a", "b")
    a, _ = pool.nodes
    for _ in range(2):
        pool.run_failed(a, "stream_broken")
    assert a.health.breaker.state == "closed"  # 5 failures open it by default
    pool.configure(RoutingConfig(policy="cache_aware", breaker_failures=3), refresh_s=1.0)
    assert pool.picker.cache_aware
    assert a.health.policy.breaker_failures == 3
    assert a.cache.capacity == RoutingConfig().cache_blocks
    pool.run_failed(a, "stream_broken")
    assert a.health.breaker.state == "open"
    assert a.health.breaker.failures == 3
    with pytest.raises(NodeUnavailableError):
        pool.pick("m", exclude=[pool.nodes[1]])


def test_a_higher_max_runs_wakes_the_queue() -> None:
    """A node's new max_runs applies at once; a higher one tells the queue a node may take
    runs it could not before."""
    pool = _pool("a")
    (a,) = pool.nodes
    woken: list[None] = []
    pool.on_available = lambda: woken.append(None)
    pool.set_max_runs(a, 1)
    a.in_flight = 1
    assert pool.pick("m") is None
    assert not woken
    pool.set_max_runs(a, 2)
    assert woken
    assert pool.pick("m") is a
