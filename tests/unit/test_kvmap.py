"""The model server's cached blocks as the edge's prefix blocks (`edge.nodes.upstream.kvmap`):
what iop-node claims is what a prompt would find cached, whatever the order of stores,
removals and runs, within its bounds."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.kvfeed import BLOCK_BYTES
from edge.nodes.upstream.kvmap import KVMap, Prompt, prompt_blocks
from edge.nodes.upstream.kvwire import Cleared, Removed, Stored

B = 4
SCOPE = ("", "m")


def _tokens(path: Sequence[int]) -> list[int]:
    """A prompt of blocks named by `path`: block b's tokens are b*100 ... b*100+B-1."""
    return [b * 100 + t for b in path for t in range(B)]


def _edge(path: Sequence[int], j: int) -> int:
    """The edge block a prompt's block j completes: one per prefix (as chained hashes)."""
    return hash(("edge", tuple(path[: j + 1]))) & (2**64 - 1)


def _prompt(path: Sequence[int], scope: tuple[str, str] = SCOPE) -> Prompt:
    edges = [_edge(path, j) for j in range(len(path))]
    needed = [(j + 1) * B for j in range(len(path))]
    return prompt_blocks(scope, _tokens(path), B, needed, edges)


def _hash(path: Sequence[int], life: int = 0) -> int:
    """The server's hash of the block ending `path` (its chain), in life `life`."""
    return hash(("server", life, tuple(path))) & (2**64 - 1)


def _store(path: Sequence[int], start: int = 0, life: int = 0) -> Stored:
    """The server storing `path`'s blocks from `start` (those before: cached already)."""
    hashes = tuple(_hash(path[: j + 1], life) for j in range(start, len(path)))
    parent = _hash(path[:start], life) if start else None
    return Stored(hashes, parent, tuple(_tokens(path[start:])), B)


def _held(kv: KVMap) -> set[int]:
    report = pb.DescribeResponse()
    kv.log.report(report, None)
    return set(report.kv_blocks_stored)


def test_a_stored_prompt_claims_its_blocks_and_a_removal_gives_up_the_chain_from_there() -> None:
    """A registered prompt whose blocks the server stores claims its edge blocks; the
    server evicting its third block gives up the third and fourth (a prompt finds only
    the first two); the third stored again claims both back."""
    kv = KVMap(B, 1000)
    path = [1, 2, 3, 4]
    kv.register(_prompt(path))
    assert _held(kv) == set()
    assert kv.apply(_store(path))
    assert _held(kv) == {_edge(path, j) for j in range(4)}
    assert kv.apply(Removed((_hash(path[:3]),)))
    assert _held(kv) == {_edge(path, 0), _edge(path, 1)}
    assert kv.apply(Stored((_hash(path[:3]),), _hash(path[:2]), tuple(_tokens([3])), B))
    assert _held(kv) == {_edge(path, j) for j in range(4)}


def test_a_run_whose_prefix_is_cached_claims_it_when_registered() -> None:
    """A second prompt sharing a stored prefix claims its edge blocks for that prefix as
    it is registered; its own next blocks, stored from there (the parent a known hash),
    claim the rest."""
    kv = KVMap(B, 1000)
    first, second = [1, 2, 3], [1, 2, 9]
    kv.register(_prompt(first))
    kv.apply(_store(first))
    held = _held(kv)
    assert kv.register(_prompt(second)) is False  # same edge blocks for the shared prefix
    assert _held(kv) == held
    kv.apply(_store(second, start=2))
    assert _held(kv) == held | {_edge(second, 2)}


def test_a_store_from_an_unknown_parent_or_first_block_is_not_placed() -> None:
    """Blocks stored under a parent never heard of (stored before the node listened), or
    a first block no run registered, claim nothing: they are counted as not placed."""
    kv = KVMap(B, 1000)
    path = [1, 2, 3]
    kv.register(_prompt(path))
    assert not kv.apply(_store(path, start=1))
    assert not kv.apply(_store([7, 8]))
    assert _held(kv) == set()
    assert kv.unplaced == 4


def test_two_scopes_with_the_same_first_tokens_are_told_apart_only_by_a_hint() -> None:
    """Two runs of different cache salts whose prompts start with the same tokens: a first
    block stored without a hint cannot be placed; one whose hints name a salt is that
    scope's, and claims that scope's edge blocks only."""
    kv = KVMap(B, 1000)
    path = [1, 2]
    a, b = _prompt(path, ("salt-a", "m")), _prompt(path, ("salt-b", "m"))
    a = Prompt(a.scope, B, a.first, a.keys, ((11,), (12,)))
    b = Prompt(b.scope, B, b.first, b.keys, ((21,), (22,)))
    kv.register(a)
    kv.register(b)
    assert not kv.apply(_store(path))
    stored = _store(path, life=1)
    assert kv.apply(Stored(stored.hashes, None, stored.tokens, B, frozenset({"salt-b"})))
    assert _held(kv) == {21, 22}


def test_a_cleared_cache_resets_and_every_watcher_gets_a_snapshot() -> None:
    """AllBlocksCleared gives up every claim; a watcher that had a report gets a snapshot
    (of nothing) next, not a list of evictions; the runs stay registered, so the same
    blocks stored again in a new life claim again."""
    kv = KVMap(B, 1000)
    path = [1, 2]
    kv.register(_prompt(path))
    kv.apply(_store(path))
    position = kv.log.report(pb.DescribeResponse(), None)
    assert kv.apply(Cleared())
    report = pb.DescribeResponse()
    kv.log.report(report, position)
    assert report.kv_blocks_snapshot
    assert report.kv_blocks_stored == []
    kv.apply(_store(path, life=1))
    assert _held(kv) == {_edge(path, 0), _edge(path, 1)}


def test_another_block_size_starts_over() -> None:
    """A store of another block size (the server runs with another `--block-size`) forgets
    what was known, and the size becomes the server's."""
    kv = KVMap(B, 1000)
    kv.register(_prompt([1, 2]))
    kv.apply(_store([1, 2]))
    assert kv.apply(Stored((5,), None, tuple(range(8)), 8))
    assert kv.block_size == 8
    assert _held(kv) == set()
    assert len(kv) == 0


def test_the_table_keeps_its_bound_and_drops_a_chains_end_first() -> None:
    """Past `max_blocks`, the least recently used go, a chain's end before its start
    (a prompt's first blocks are the most recently used of it); a dropped block gives up
    its claims."""
    kv = KVMap(B, 5)
    old, new = [1, 2, 3, 4], [5, 6, 7]
    kv.register(_prompt(old))
    kv.apply(_store(old))
    kv.register(_prompt(new))
    kv.apply(_store(new))
    assert len(kv) == 5
    assert _held(kv) == {_edge(old, 0), _edge(old, 1)} | {_edge(new, j) for j in range(3)}


def test_a_block_of_the_map_takes_less_memory_than_its_budget() -> None:
    """10,000 stored blocks of registered prompts (one edge block each) take under
    BLOCK_BYTES each (the budget `--kv-table-mib` is divided by)."""
    kv = KVMap(16, 1_000_000)
    paths = [[p, *range(1000 + 10 * p, 1000 + 10 * p + 9)] for p in range(1000)]
    prompts = [
        prompt_blocks(
            SCOPE,
            [t for b in path for t in [b] * 16],
            16,
            [(j + 1) * 16 for j in range(10)],
            [hash((tuple(path), j)) & (2**64 - 1) for j in range(10)],
        )
        for path in paths
    ]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for n, (path, prompt) in enumerate(zip(paths, prompts, strict=True)):
        kv.register(prompt)
        tokens = tuple(t for b in path for t in [b] * 16)
        kv.apply(Stored(tuple(range(n * 10 + 1, n * 10 + 11)), None, tokens, 16))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert len(kv) == 10_000
    assert used / len(kv) < BLOCK_BYTES, used / len(kv)


_PATHS = st.lists(st.integers(0, 3), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.lists(_PATHS, min_size=1, max_size=5), st.lists(st.tuples(st.integers(0, 2),
       st.integers(0, 50)), max_size=40))  # fmt: skip
def test_what_is_claimed_is_what_a_registered_prompt_finds_cached(
    paths: list[list[int]], ops: list[tuple[int, int]]
) -> None:
    """Registered prompts, then stores (a block whose parent is cached), removals (any
    cached block, a chain's start included) and clears in any order: the edge blocks
    claimed are exactly those of the registered prompts whose blocks up to there are all
    cached (as a prefix lookup would find them)."""
    kv = KVMap(B, 10_000)
    for path in paths:
        kv.register(_prompt(path))
    cached: set[tuple[int, ...]] = set()  # the server's blocks, by their chain
    life = 0
    for kind, pick in ops:
        if kind == 0:  # store a block whose parent is cached
            choices = sorted({tuple(p[: j + 1]) for p in paths for j in range(len(p))
                              if tuple(p[: j + 1]) not in cached and (j == 0 or tuple(p[:j])
                              in cached)})  # fmt: skip
            if choices:
                chain = choices[pick % len(choices)]
                kv.apply(_store(list(chain), start=len(chain) - 1, life=life))
                cached.add(chain)
        elif kind == 1 and cached:
            chain = sorted(cached)[pick % len(cached)]
            kv.apply(Removed((_hash(chain, life),)))
            cached.discard(chain)
        elif kind == 2 and pick % 10 == 0:
            kv.apply(Cleared())
            cached.clear()
            life += 1
    expected = {
        _edge(p, j)
        for p in paths
        for j in range(len(p))
        if all(tuple(p[: k + 1]) in cached for k in range(j + 1))
    }
    assert _held(kv) == expected
