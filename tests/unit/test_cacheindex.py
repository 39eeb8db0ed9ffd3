"""A node's cache index (edge.fleet.cacheindex): bounded whatever it is fed, the longest
cached prefix by binary search, the correction by usage, the exact mode's events."""

from __future__ import annotations

from array import array
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from edge.contract.prefix import MAX_PREFIX_BLOCKS
from edge.fleet.cacheindex import LIVE_WINDOW, MAX_BLOCKS, CacheIndex


def chain(start: int, n: int) -> array[int]:
    """`n` distinct block hashes (a chain's, for the index's purposes)."""
    return array("Q", range(start, start + n))


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("routed"), st.integers(0, 50), st.integers(0, 40)),
        st.tuples(st.just("corrected"), st.integers(0, 50), st.integers(0, 40)),
        st.tuples(st.just("resize"), st.integers(-5, 60), st.just(0)),
        st.tuples(st.just("snapshot"), st.integers(0, 50), st.integers(0, 80)),
        st.tuples(st.just("reported"), st.integers(0, 50), st.integers(0, 80)),
    ),
    max_size=40,
)


@given(st.integers(1, 60), _OPS)
def test_the_index_never_holds_more_than_its_capacity(capacity: int, ops: list[Any]) -> None:
    """Whatever routing, usage, resizes and a node's events feed it, an index holds at
    most its capacity in blocks (at least 1, at most MAX_BLOCKS), and its live demand
    at most MAX_PREFIX_BLOCKS more."""
    index = CacheIndex(capacity)
    for tick, (op, start, n) in enumerate(ops):
        if op == "routed":
            index.routed(chain(start, n), tick)
        elif op == "corrected":
            index.corrected(chain(start, n), n, n // 2)
        elif op == "resize":
            index.resize(start)
        elif op == "reported":  # stores, with room for evictions that may not be held
            index.reported(chain(start, n), chain(start // 2, n // 3), tick)
        else:
            index.snapshot(chain(start, n))
        assert 1 <= index.capacity <= MAX_BLOCKS
        assert len(index) <= index.capacity
        assert index.live(tick) <= index.capacity + MAX_PREFIX_BLOCKS


def test_the_live_demand_is_what_was_sent_over_the_last_window() -> None:
    """A block sent with dispatch t counts in the live demand up to dispatch
    t + LIVE_WINDOW - 1; sent again, from then on. A chain's head sent again outlives
    its tail."""
    index = CacheIndex(1000)
    index.routed(chain(0, 6), 1)
    assert index.live(1) == index.live(LIVE_WINDOW) == 6
    index.routed(chain(0, 2), 10)  # the head again
    assert index.live(LIVE_WINDOW + 1) == 2
    assert index.live(LIVE_WINDOW + 9) == 2
    assert index.live(LIVE_WINDOW + 10) == 0


def test_room_is_for_the_blocks_not_already_in_the_live_demand() -> None:
    """A node with room for none but its live demand: a request of blocks it was sent
    lately fits, one of new blocks does not, until the demand expires."""
    index = CacheIndex(10)
    index.routed(chain(0, 8), 0)
    assert index.has_room(chain(0, 10), 0)  # 2 new blocks: 10 of 10
    assert not index.has_room(chain(0, 11), 0)
    assert not index.has_room(chain(100, 3), 0)
    assert index.has_room(chain(100, 3), LIVE_WINDOW)


def test_an_exact_index_keeps_the_live_demand_but_not_the_blocks_routed() -> None:
    """With the node's own events, routing adds nothing to what it holds, and to its live
    demand all the same, as do the blocks it reports storing (not those of a snapshot);
    a full cache of blocks nobody was sent lately has room."""
    index = CacheIndex(10)
    index.snapshot(chain(500, 10))
    assert index.has_room(chain(0, 10), 0)  # full, but of blocks not in use
    index.routed(chain(0, 4), 0)
    assert len(index) == 10
    assert index.longest(chain(0, 4)) == 0
    assert index.live(0) == 4
    assert not index.has_room(chain(100, 7), 0)
    index.reported(chain(600, 3), (), 0)  # what the node reports storing counts too
    assert index.live(0) == 7
    assert index.live(LIVE_WINDOW) == 0  # a snapshot's blocks never did
    index.clear()  # the node stopped reporting: the live demand is the traffic's
    index.routed(chain(0, 4), LIVE_WINDOW)
    assert index.live(LIVE_WINDOW) == 4


@given(st.integers(0, 64), st.integers(0, 64))
def test_longest_is_the_held_prefix_of_a_prefix_closed_chain(held: int, n: int) -> None:
    """With the chain's first `held` blocks held (and none after), the longest cached
    prefix of its first `n` blocks is min(held, n)."""
    index = CacheIndex(1000)
    index.snapshot(chain(0, held))
    assert index.longest(chain(0, n)) == min(held, n)


@given(st.sets(st.integers(0, 31)), st.integers(1, 32))
def test_with_holes_the_search_still_lands_on_a_boundary_of_what_is_held(
    held: set[int], n: int
) -> None:
    """An exact index may hold block k without an earlier one: the search then answers
    a boundary k (block k-1 held, block k not or the chain's end), exact when the held
    blocks are a prefix of the chain, 0 when block 0 is not held."""
    index = CacheIndex(1000)
    index.snapshot(array("Q", held))
    found = index.longest(chain(0, n))
    assert 0 <= found <= n
    assert found == 0 or (found - 1) in held
    assert found == n or found not in held
    if 0 not in held:
        assert found == 0
    if held >= set(range(n)):
        assert found == n


def test_the_lru_evicts_a_prefixs_tail_first_and_the_least_recent_prefix_first() -> None:
    """Routed blocks are recorded deepest first: filling the index past its capacity
    evicts the least recently routed prefix's last blocks, keeping its head."""
    index = CacheIndex(6)
    a, b = chain(0, 4), chain(100, 4)
    index.routed(a, 0)
    index.routed(b, 0)  # 8 blocks for 6: a's last two go
    assert index.longest(a) == 2
    assert index.longest(b) == 4
    index.routed(a[:2], 0)  # a's head used again: b is now the least recent
    index.routed(chain(200, 2), 0)
    assert index.longest(b) == 2
    assert index.longest(a) == 2


def test_a_run_that_found_fewer_cached_tokens_drops_the_blocks_past_them() -> None:
    """The index predicted 6 cached blocks; the node had 2: blocks 2.. are dropped (the
    prediction of the next request of that prefix is 2). A node with as many or more
    changes nothing."""
    index = CacheIndex(100)
    blocks = chain(0, 8)
    index.routed(blocks, 0)
    index.corrected(blocks, predicted=6, cached=6)
    assert index.longest(blocks) == 8
    index.corrected(blocks, predicted=6, cached=2)
    assert index.longest(blocks) == 2
    assert len(index) == 2


def test_an_exact_index_follows_the_nodes_events_and_ignores_routing() -> None:
    """A snapshot replaces the set and makes the index exact; stores then evictions
    apply in order; routing and usage change nothing; `clear` makes it approximate."""
    index = CacheIndex(100)
    index.routed(chain(500, 3), 0)
    index.snapshot(chain(0, 4))
    assert 500 not in index
    assert index.exact
    index.routed(chain(500, 3), 0)
    index.corrected(chain(0, 4), predicted=4, cached=0)
    assert 500 not in index
    assert index.longest(chain(0, 4)) == 4
    index.reported(chain(4, 2), chain(2, 1))
    assert index.longest(chain(0, 6)) in (2, 6)  # a hole at 2: a lower bound
    assert index.longest(chain(0, 2)) == 2
    index.clear()
    assert not index.exact
    assert len(index) == 0


def test_a_full_nodes_report_of_stores_and_evictions_keeps_every_block_it_holds() -> None:
    """A node at its capacity stores a block by evicting another: its report gives both,
    stores first. The index, full too, keeps the new block (the report's evictions made
    room for it) and drops the evicted one, so it holds exactly the node's set; evictions
    of blocks it did not hold leave it at most its capacity."""
    index = CacheIndex(4)
    index.snapshot(chain(0, 4))
    index.reported(chain(100, 2), chain(2, 2))
    assert len(index) == 4
    assert all(block in index for block in [*chain(0, 2), *chain(100, 2)])
    index.reported(chain(200, 2), [999_999, chain(100, 2)[1]])
    assert len(index) == 4
    assert chain(200, 2)[1] in index


def test_a_node_storing_past_its_capacity_is_kept_to_it() -> None:
    """An exact node reporting more blocks than its capacity: the index keeps its
    capacity's worth and ignores the rest (a node is not trusted)."""
    index = CacheIndex(10)
    index.snapshot(chain(0, 1000))
    assert len(index) == 10
    index.reported(chain(5000, 5), ())
    assert len(index) == 10
