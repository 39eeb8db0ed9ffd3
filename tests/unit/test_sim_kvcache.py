"""The simulated node's KV cache model (`edge.nodes.sim.kvcache`): a prompt's cached
leading run, LRU eviction by chain ends, its bounds, and the prompt's size.

Pure: the cache and its block log, no node. Block hashes here are small made-up
numbers; a chain is a list of them, each standing for its block and all before it.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import (
    BLOCK_TOKENS,
    CHARS_PER_TOKEN,
    MAX_KV_BLOCKS_PER_REPORT,
    MAX_PREFIX_BLOCKS,
)
from edge.nodes.sim import cli
from edge.nodes.sim.kvcache import MAX_KV_TOKENS, KVCache, KVSettings, prompt
from edge.nodes.sim.server import SimNode
from tests.unit.blockchains import Chains, Watcher


def _events(cache: KVCache, position: int) -> tuple[list[int], list[int]]:
    """The stored and evicted blocks the cache's log reports since `position`."""
    report = pb.DescribeResponse()
    cache.log.report(report, position)
    assert not report.kv_blocks_snapshot
    return list(report.kv_blocks_stored), list(report.kv_blocks_evicted)


def test_a_prompts_cached_tokens_are_its_longest_leading_run_held() -> None:
    """A prompt matches the blocks held from its first on, up to the first one missing:
    a held block after a missing one does not count."""
    cache = KVCache(16)
    cache.store([1, 2, 3])
    assert cache.match([1, 2, 3, 4]) == 3
    assert cache.match([1, 2]) == 2
    assert cache.match([1, 9, 3]) == 1
    assert cache.match([9, 1, 2]) == 0
    assert cache.match([]) == 0


def test_blocks_keep_the_time_the_run_that_first_stored_them_computes_them() -> None:
    """A block stored by a run is computed when that run's prefill ends; a later run
    touching it does not change that, and the blocks it adds get its own time. A match
    is ready once the latest of its blocks is."""
    cache = KVCache(16)
    cache.store([1, 2], ready=5.0)
    cache.store([1, 2, 3], ready=9.0)
    assert cache.ready([1, 2, 3], 2) == 5.0
    assert cache.ready([1, 2, 3], 3) == 9.0
    assert cache.ready([1, 2, 3], 0) == 0.0


def test_storing_touches_held_blocks_and_records_only_new_ones() -> None:
    """A run's blocks held already are touched, not stored again (no event for them),
    and the cache reports a change only when its set changed."""
    cache = KVCache(16)
    assert cache.store([1, 2]) is True
    start = cache.log.end
    assert cache.store([1, 2]) is False
    assert cache.log.end == start
    assert cache.store([1, 2, 3]) is True
    assert _events(cache, start) == ([3], [])
    assert cache.held == 3


def test_the_least_recently_used_chains_go_first_ends_before_beginnings() -> None:
    """Past the capacity the least recently used blocks go, and of one chain its end
    first (a run frees its blocks last to first): a prefix is never left with a hole,
    and a chain touched again outlives one that was not. New blocks are stored in chain
    order, each evicting one once the pool is full."""
    cache = KVCache(4)
    cache.store([1, 2])  # chain a
    cache.store([3, 4])  # chain b
    cache.store([1, 2])  # a used again: b is now the least recent
    assert cache.blocks() == [4, 3, 2, 1]
    start = cache.log.end
    cache.store([5, 6])  # chain c: two blocks must go, b's
    assert _events(cache, start) == ([5, 6], [4, 3])
    assert cache.blocks() == [2, 1, 6, 5]
    assert cache.match([1, 2]) == 2
    start = cache.log.end
    cache.store([7])  # one must go: the end of a (2), a's first block (1) stays
    assert _events(cache, start) == ([7], [2])
    assert cache.match([1, 2]) == 1


def test_a_run_keeps_its_own_held_blocks_when_it_evicts() -> None:
    """A run's blocks held already are touched before anything is evicted, so a run never
    evicts its own cached prefix to store its new blocks."""
    cache = KVCache(3)
    cache.store([1])
    cache.store([8, 9])  # 1 is now the least recently used
    cache.store([1, 2])  # touches 1, stores 2, then evicts the oldest: 9
    assert 1 in cache
    assert 2 in cache
    assert cache.blocks() == [8, 2, 1]


def test_a_prompt_longer_than_the_cache_keeps_its_first_blocks() -> None:
    """A run stores at most `capacity` blocks, its first: they stay together and match."""
    cache = KVCache(3)
    cache.store([1, 2, 3, 4, 5])
    assert cache.blocks() == [3, 2, 1]
    assert cache.match([1, 2, 3, 4, 5]) == 3


def test_capacity_zero_holds_nothing() -> None:
    """A cache of 0 blocks (a --kv-tokens under one block) matches and stores nothing,
    and its log has no event."""
    cache = KVCache(0)
    assert cache.store([1, 2, 3]) is False
    assert cache.match([1, 2, 3]) == 0
    assert (cache.held, cache.log.end) == (0, 0)


def test_a_run_counts_at_most_max_prefix_blocks() -> None:
    """However many blocks a request carries, the cache looks at and holds its first
    MAX_PREFIX_BLOCKS, in a cache of the largest capacity."""
    cache = KVCache(MAX_KV_BLOCKS_PER_REPORT)
    blocks = list(range(1, 2 * MAX_PREFIX_BLOCKS + 1))
    cache.store(blocks)
    assert cache.held == MAX_PREFIX_BLOCKS
    assert cache.match(blocks) == MAX_PREFIX_BLOCKS


def test_the_cache_refuses_a_capacity_past_one_report() -> None:
    """A cache holds at most MAX_KV_BLOCKS_PER_REPORT blocks (a snapshot fits one report);
    the settings refuse a capacity, or a time, out of range."""
    with pytest.raises(ValueError, match="capacity"):
        KVCache(MAX_KV_BLOCKS_PER_REPORT + 1)
    assert MAX_KV_TOKENS == MAX_KV_BLOCKS_PER_REPORT * BLOCK_TOKENS
    KVSettings(kv_tokens=MAX_KV_TOKENS)
    for bad in (
        {"kv_tokens": MAX_KV_TOKENS + 1},
        {"kv_tokens": -1},
        {"prefill_us_per_token": -1.0},
        {"prefill_us_per_token": math.inf},
        {"decode_tokens_per_s": math.nan},
    ):
        with pytest.raises(ValueError, match="must be"):
            KVSettings(**bad)  # type: ignore[arg-type]


def test_a_prompts_size_comes_from_the_fingerprint_or_else_its_messages() -> None:
    """With `prompt_chars` the prompt is prompt_chars // 4 tokens and its blocks are the
    first MAX_PREFIX_BLOCKS; without (an older edge) it is its messages' text // 4 tokens,
    and no block (nothing cached)."""
    blocks = list(range(MAX_PREFIX_BLOCKS + 10))
    fingerprinted = pb.RunRequest(prompt_chars=1003, prefix_blocks=blocks)
    assert prompt(fingerprinted).tokens == 1003 // CHARS_PER_TOKEN
    assert list(prompt(fingerprinted).blocks) == blocks[:MAX_PREFIX_BLOCKS]
    parts = [pb.ContentPart(type="text", text="b" * 20), pb.ContentPart(type="text", text="c")]
    older = pb.RunRequest(
        prefix_blocks=[1, 2],
        messages=[
            pb.Message(role="system", content="a" * 40),
            pb.Message(role="user", parts=parts),
        ],
    )
    assert prompt(older).tokens == 61 // CHARS_PER_TOKEN
    assert list(prompt(older).blocks) == []
    huge = pb.RunRequest(prompt_chars=2**64 - 1)
    assert prompt(huge).tokens == 2**32 - 1  # usage is uint32


def test_a_continued_runs_prompt_counts_the_partial_answer_after_its_blocks() -> None:
    """A run that continues an answer prefills what its continuation holds too (text and
    reasoning, 4 characters a token); its blocks stay the prompt's own."""
    held = pb.Continuation(text="t" * 30, reasoning="r" * 10)
    continued = pb.RunRequest(prompt_chars=1000, prefix_blocks=[1, 2, 3], continuation=held)
    assert prompt(continued).tokens == 1040 // CHARS_PER_TOKEN
    assert list(prompt(continued).blocks) == [1, 2, 3]
    older = pb.RunRequest(messages=[pb.Message(role="user", content="u" * 20)], continuation=held)
    assert prompt(older).tokens == 60 // CHARS_PER_TOKEN


# A workload: runs whose chains branch from a few roots, so that they share prefixes.
_RUNS = st.lists(
    st.lists(st.integers(min_value=0, max_value=3), min_size=0, max_size=12),
    min_size=1,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(min_value=0, max_value=16), runs=_RUNS, every=st.integers(1, 7))
def test_any_workload_keeps_the_bound_whole_prefixes_and_a_true_log(
    capacity: int, runs: list[list[int]], every: int
) -> None:
    """Whatever the runs: the cache holds at most its capacity; every block held has the
    blocks before it in its chain held (so a match is never cut by a hole); the match is
    the leading run held; and a watcher that applies each report (stored, then evicted)
    to its own set, reading after every `every` runs, has exactly the set held."""
    chains = Chains()
    cache = KVCache(capacity)
    watcher = Watcher(cache.log)
    for n, path in enumerate(runs):
        chain = chains.chain(path)
        held_run = 0
        while held_run < len(chain) and chain[held_run] in cache:
            held_run += 1
        assert cache.match(chain) == held_run
        cache.store(chain)
        assert cache.held <= capacity
        assert chains.unbroken(cache)
        if n % every == 0:
            watcher.read()
    watcher.read()
    assert watcher.seen == set(cache.blocks())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-tokens", str(MAX_KV_TOKENS + 1)], "must be 4194304 or less"),
        (["--kv-tokens", "-1"], "must be 0 or more"),
        (["--prefill-us-per-token", "-1"], "must be a finite number from 0"),
        (["--prefill-us-per-token", "nan"], "must be a finite number from 0"),
        (["--decode-tokens-per-s", "inf"], "must be a finite number from 0"),
        (["--decode-tokens-per-s", "fast"], "not a number"),
    ],
)
def test_the_node_refuses_a_cache_model_flag_out_of_range(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`iop-sim-node` answers a cache size past one report, or a time that is negative or
    not finite, with a usage error naming the flag and the bound, before it serves."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--listen", "127.0.0.1:0", *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert flags[0] in error
    assert message in error


def test_a_node_without_kv_reports_keeps_its_cache_and_no_block_log() -> None:
    """`kv_reports=False` (`--no-kv-reports`): the node still models its cache, but gives
    its Watch reports no block log, so they carry no KV block events; by default, with
    the cache model on, the cache's log is the node's."""
    quiet = SimNode(kv=KVSettings(kv_tokens=4096), kv_reports=False)
    assert quiet.cache is not None
    assert quiet.block_log is None
    told = SimNode(kv=KVSettings(kv_tokens=4096))
    assert told.cache is not None
    assert told.block_log is told.cache.log
