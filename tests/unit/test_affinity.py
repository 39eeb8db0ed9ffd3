"""Session affinity (edge.fleet.affinity): rendezvous hashing with bounded load."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from edge.fleet import affinity

names = st.lists(
    st.text(alphabet="abcdefghij-0123456789", min_size=1, max_size=8),
    min_size=1,
    max_size=8,
    unique=True,
)
keys = st.lists(st.text(max_size=20), min_size=1, max_size=40, unique=True)


def preferred(key: str, nodes: list[str]) -> str:
    return nodes[affinity.order(key, nodes)[0]]


@given(names, keys)
def test_order_is_a_permutation_and_does_not_depend_on_the_listing(
    nodes: list[str], sessions: list[str]
) -> None:
    """A key's order holds every node once, and is the same whatever order the nodes are
    listed in (it depends on the names only: every edge process agrees)."""
    for key in sessions:
        ranked = affinity.order(key, nodes)
        assert sorted(ranked) == list(range(len(nodes)))
        backwards = list(reversed(nodes))
        assert [backwards[i] for i in affinity.order(key, backwards)] == [nodes[i] for i in ranked]


@given(names, keys, st.data())
def test_a_node_leaving_moves_only_its_own_keys(
    nodes: list[str], sessions: list[str], data: st.DataObject
) -> None:
    """Removing one node moves exactly the keys it held, each to the next node in its own
    order; every other key stays where it was."""
    assume(len(nodes) >= 2)
    gone = data.draw(st.sampled_from(nodes))
    left = [n for n in nodes if n != gone]
    for key in sessions:
        before = [nodes[i] for i in affinity.order(key, nodes)]
        after = preferred(key, left)
        if before[0] == gone:
            assert after == before[1]
        else:
            assert after == before[0]


@given(names, keys, st.text(alphabet="klmnop", min_size=1, max_size=8))
def test_a_node_joining_takes_keys_only_for_itself(
    nodes: list[str], sessions: list[str], new: str
) -> None:
    """Adding a node moves a key only to the new node, never between the old ones."""
    assume(new not in nodes)
    for key in sessions:
        before = preferred(key, nodes)
        after = preferred(key, [*nodes, new])
        assert after in (before, new)


def test_keys_spread_over_the_nodes_and_a_new_node_takes_about_its_share() -> None:
    """2,000 sessions over 4 nodes: each node gets a fair part (within 30% of even); a
    fifth node takes about a fifth of them, from every old node, and nothing else moves."""
    nodes = ["node-a", "node-b", "node-c", "node-d"]
    sessions = [f"session-{i}" for i in range(2000)]
    placed = {key: preferred(key, nodes) for key in sessions}
    for node, count in Counter(placed.values()).items():
        assert 0.7 * 500 <= count <= 1.3 * 500, node
    moved = {key for key in sessions if preferred(key, [*nodes, "node-e"]) != placed[key]}
    assert 0.7 * 400 <= len(moved) <= 1.3 * 400
    assert {placed[key] for key in moved} == set(nodes)


@given(
    st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=8),
    st.text(max_size=10),
)
def test_choice_is_the_first_in_order_within_the_load_bound(loads: list[int], key: str) -> None:
    """The chosen node is within 1.25 x the mean load + 1, and every node the key prefers
    to it is past that bound."""
    nodes = [(f"n{i}", load) for i, load in enumerate(loads)]
    chosen = affinity.choose(key, nodes)
    bound = affinity.LOAD_FACTOR * sum(loads) / len(loads) + 1
    assert loads[chosen] <= bound
    ranked = affinity.order(key, [name for name, _ in nodes])
    for i in ranked[: ranked.index(chosen)]:
        assert loads[i] > bound


def test_a_session_stays_while_the_load_is_even_and_moves_when_its_node_runs_hot() -> None:
    """With even loads a key keeps its node; once that node runs more than 1.25 x the mean
    + 1, the key goes to its next node."""
    names_ = ["a", "b", "c"]
    key = "user-42"
    first, second = affinity.order(key, names_)[:2]
    even = [(n, 4) for n in names_]
    assert affinity.choose(key, even) == first
    hot = [(n, 12 if i == first else 4) for i, n in enumerate(names_)]
    # mean 20/3, bound 9.33: the preferred node at 12 is past it.
    assert affinity.choose(key, hot) == second
    small = [(n, 1 if i == first else 0) for i, n in enumerate(names_)]
    assert affinity.choose(key, small) == first  # +1: one run does not move a session


def test_choose_needs_a_node() -> None:
    with pytest.raises(ValueError, match="no node"):
        affinity.choose("k", [])
