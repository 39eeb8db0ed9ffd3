"""The simulated node's KV cache model with runs in flight (`edge.nodes.sim.kvcache`,
`KVCache.start`, `decoded`, `end`): a running run's blocks are pinned, its own blocks
(a partial prompt block, its answer) take room and evict the least recently freed
blocks, and its end frees them to the free queue, its own first.

Pure, except the last tests: a simulated node (`SimNode.play` on an asyncio loop of
their own) whose runs end every way, each freeing its blocks once. Block hashes are
small made-up numbers, a chain a list of them.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from grpclib.exceptions import GRPCError
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import BLOCK_TOKENS, PREFIX_BLOCK_CHARS
from edge.nodes.runslog import RunRecord
from edge.nodes.sim.kvcache import KVCache, KVSettings, Lease
from edge.nodes.sim.server import SimNode
from tests.unit.blockchains import Chains, Watcher


def _events(cache: KVCache, position: int) -> tuple[list[int], list[int]]:
    """The stored and evicted blocks the cache's log reports since `position`."""
    report = pb.DescribeResponse()
    cache.log.report(report, position)
    assert not report.kv_blocks_snapshot
    return list(report.kv_blocks_stored), list(report.kv_blocks_evicted)


def _bounded(cache: KVCache) -> None:
    """The pool's bounds (the module doc): at most `capacity` blocks held, and free blocks
    only in the room the blocks in use leave."""
    assert cache.held <= cache.capacity
    assert cache.free <= max(0, cache.capacity - cache.in_use)


def test_a_running_runs_prompt_blocks_survive_any_pressure() -> None:
    """A run's cached blocks are pinned from its start to its end: other runs' prompts,
    however many, evict only the blocks no run uses, and the pinned ones stay held."""
    cache = KVCache(6)
    lease = cache.start([1, 2, 3], 3 * BLOCK_TOKENS)
    for chain in ([10, 11], [20, 21, 22], [30, 31], [40, 41, 42]):
        cache.store(chain)
        assert cache.match([1, 2, 3]) == 3
        _bounded(cache)
    assert cache.pinned == 3
    assert cache.blocks()[-3:] == [1, 2, 3]  # pinned: the most recent
    cache.end(lease)
    assert cache.pinned == 0
    assert cache.blocks() == [42, 41, 40, 3, 2, 1]
    cache.store([50, 51, 52, 53])  # the least recently freed go: 42, 41, 40, then 3
    assert cache.match([1, 2, 3]) == 2


def test_a_runs_answer_takes_blocks_that_evict_the_least_recently_freed_prefixes() -> None:
    """The tokens a run generates take a block each BLOCK_TOKENS (after its partial prompt
    block): once the pool is full, each new one evicts the free queue's head, a chain's
    end before its beginning, and the index learns it from the log."""
    cache = KVCache(7)
    cache.store([1, 2])  # chain a, the least recent
    cache.store([3, 4])  # chain b
    lease = cache.start([5], BLOCK_TOKENS + 10)  # one whole block and a partial one
    assert (lease.private, cache.in_use, cache.free) == (1, 2, 4)
    start = cache.log.end
    assert cache.decoded(lease, 50) is False  # 60 tokens in its partial block: no new one
    assert cache.decoded(lease, 10) is True  # 70: a block more, which the pool still has
    assert cache.in_use + cache.free == cache.capacity
    assert _events(cache, start) == ([], [])
    assert cache.decoded(lease, 64) is True  # one more: a's end goes
    assert _events(cache, start) == ([], [2])
    cache.decoded(lease, 64)
    assert _events(cache, start) == ([], [2, 1])
    assert cache.match([1, 2]) == 0
    assert cache.match([3, 4]) == 2
    assert lease.private == 4
    _bounded(cache)


def test_a_runs_end_frees_its_own_blocks_first_then_its_prompt_last_to_first() -> None:
    """A run that ends frees its blocks to the free queue's tail in reverse order: its own
    (anonymous: no event when they go) before its prompt's, and of its prompt the last
    block before the first. Its blocks are no longer in use, and a second end, or a delta
    after the end, changes nothing."""
    cache = KVCache(8)
    lease = cache.start([1, 2, 3], 3 * BLOCK_TOKENS + 10)
    cache.decoded(lease, 100)  # 302 tokens: 5 blocks, 2 of its own
    assert (cache.pinned, cache.in_use, lease.private) == (3, 5, 2)
    assert cache.end(lease) is True
    assert (cache.pinned, cache.in_use, cache.free) == (0, 0, 5)
    assert cache.end(lease) is False
    assert cache.decoded(lease, 1000) is False
    assert (cache.in_use, cache.free) == (0, 5)
    assert cache.blocks() == [3, 2, 1]
    start = cache.log.end
    cache.store([7, 8, 9, 10, 11])  # 5 blocks into 3 free slots: the 2 anonymous go
    assert _events(cache, start) == ([7, 8, 9, 10, 11], [])
    start = cache.log.end
    cache.store([12])  # then the end of the first run's chain
    assert _events(cache, start) == ([12], [3])


def test_blocks_shared_by_runs_stay_pinned_until_the_last_of_them_ends() -> None:
    """Runs of the same prefix share its blocks (counted once in use); a block stays
    pinned while any run using it plays, and is freed when the last one ends."""
    cache = KVCache(4)
    first = cache.start([1, 2], 2 * BLOCK_TOKENS)
    second = cache.start([1, 2, 3], 3 * BLOCK_TOKENS)
    assert (cache.pinned, cache.in_use) == (3, 3)
    cache.end(second)  # 3 freed; 1 and 2 still in the first run's use
    assert (cache.pinned, cache.free) == (2, 1)
    cache.store([7, 8])  # one slot is new, the other is 3's
    assert cache.match([1, 2, 3]) == 2
    cache.end(first)
    assert (cache.pinned, cache.in_use) == (0, 0)
    assert cache.blocks() == [8, 7, 2, 1]


def test_more_runs_than_fit_play_with_no_free_block_and_store_no_more() -> None:
    """The documented rule: runs whose blocks exceed the capacity still start; the free
    queue is emptied to make room (the prefixes no run uses are evicted), a block that
    finds no room is the run's own (not cached, never reported), and once runs end the
    pool is back within its capacity. At no time does it hold more than `capacity`
    cached blocks, nor keep a free block while the blocks in use fill it."""
    cache = KVCache(4)
    cache.store([1, 2])
    big = cache.start([5, 6, 7], 3 * BLOCK_TOKENS + 100)  # 5 blocks: 3 cached, 2 its own
    assert cache.match([1, 2]) == 0
    assert (cache.in_use, cache.free, cache.held) == (5, 0, 3)
    other = cache.start([8], BLOCK_TOKENS)  # no room: its block is its own, uncached
    assert (other.blocks, other.private, cache.match([8])) == ((), 1, 0)
    assert (cache.in_use, cache.held) == (6, 3)
    _bounded(cache)
    cache.end(big)
    _bounded(cache)
    assert (cache.in_use, cache.blocks()) == (1, [7, 6, 5])
    cache.end(other)
    assert (cache.in_use, cache.free, cache.blocks()) == (0, 4, [7, 6, 5])


# Operations on runs: start a run of a chain (a path of branches from a few roots, so
# that runs share prefixes) with some tokens past its blocks; a run decodes some tokens;
# a run ends (the n-th of those in flight, modulo their number).
_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("start"),
            st.lists(st.integers(0, 3), min_size=0, max_size=8),
            st.integers(0, 3 * BLOCK_TOKENS),
        ),
        st.tuples(st.just("decode"), st.integers(0, 20), st.integers(1, 2 * BLOCK_TOKENS)),
        st.tuples(st.just("end"), st.integers(0, 20), st.just(0)),
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 16), ops=_OPS, every=st.integers(1, 9))
def test_any_interleaving_of_runs_keeps_pins_bounds_whole_prefixes_and_a_true_log(
    capacity: int, ops: list[tuple[str, Any, int]], every: int
) -> None:
    """Whatever runs start, decode and end, in any order: every block a run in flight holds
    cached stays held; the blocks in use are the runs' blocks, each once, and their own
    ones, as many as their tokens need past their cached blocks; the pool holds at most
    its capacity and free blocks only in the room left; every block held has the blocks
    before it in its chain; and a watcher applying each report (stored, then evicted) to
    its own set, reading every `every` operations, has exactly the set held. Once every
    run ended, nothing is in use."""
    chains = Chains()
    cache = KVCache(capacity)
    watcher = Watcher(cache.log)
    live: list[Lease] = []

    def check() -> None:
        _bounded(cache)
        pinned = {block for lease in live for block in lease.blocks}
        assert all(block in cache for block in pinned)
        assert cache.pinned == len(pinned)
        for lease in live:
            need = math.ceil((lease.tokens + lease.generated) / BLOCK_TOKENS)
            assert lease.private == max(0, need - len(lease.blocks))
        assert cache.in_use == len(pinned) + sum(lease.private for lease in live)
        assert chains.unbroken(cache)
        assert len(cache.blocks()) == cache.held

    for n, (op, arg, tokens) in enumerate(ops):
        if op == "start":
            chain = chains.chain(arg)
            held_run = cache.match(chain)
            lease = cache.start(chain, len(chain) * BLOCK_TOKENS + tokens)
            assert len(lease.blocks) >= held_run  # its cached prefix, then what it stored
            assert list(lease.blocks) == chain[: len(lease.blocks)]
            live.append(lease)
        elif op == "decode" and live:
            cache.decoded(live[arg % len(live)], tokens)
        elif op == "end" and live:
            assert cache.end(live.pop(arg % len(live))) is True
        check()
        if n % every == 0:
            watcher.read()
    watcher.read()
    assert watcher.seen == set(cache.blocks())
    while live:
        cache.end(live.pop())
        check()
    assert (cache.in_use, cache.pinned) == (0, 0)
    watcher.read()
    assert watcher.seen == set(cache.blocks())


# --- a node's runs: every way a run ends frees its blocks, once ---------------------------


class _Stream:
    """A run's event stream that keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.some = asyncio.Event()

    async def send_message(self, event: Any) -> None:
        self.sent.append(event)
        self.some.set()


def _run(
    events: list[dict[str, Any]], blocks: list[int]
) -> tuple[RunRecord, _Stream, pb.RunRequest]:
    """A sim-script run of `events` whose prompt is `blocks` whole blocks and 100
    characters more, and its stream."""
    request = pb.RunRequest(
        run_id="r",
        model="sim-script",
        messages=[pb.Message(role="user", content=json.dumps({"events": events}))],
        prefix_blocks=blocks,
        prompt_chars=len(blocks) * PREFIX_BLOCK_CHARS + 100,
    )
    run, stream = RunRecord("r", "sim-script"), _Stream()
    run.stream = stream  # type: ignore[assignment]
    return run, stream, request


def _node() -> tuple[SimNode, KVCache]:
    node = SimNode(kv=KVSettings(kv_tokens=16 * BLOCK_TOKENS, prefill_us_per_token=0.0))
    assert node.cache is not None
    return node, node.cache


@pytest.mark.parametrize(
    ("last", "outcome"),
    [
        ({"type": "complete"}, "complete"),
        ({"type": "error", "error": "boom"}, "error"),
        ({"type": "cancelled"}, "cancelled"),
    ],
)
def test_a_run_that_ends_by_its_terminal_frees_its_blocks(
    last: dict[str, Any], outcome: str
) -> None:
    """A run holds its prompt's blocks and its answer's while it plays (Describe's use
    says so), and frees them when it ends by any terminal event: its prefix stays cached,
    in no run's use."""
    node, cache = _node()
    run, _, request = _run([{"type": "delta", "delta": "x" * 400}, last], [1, 2])

    async def play() -> str:
        return await node.play(run, request, None)

    assert asyncio.run(play()) == outcome
    assert (cache.in_use, cache.pinned, cache.match([1, 2])) == (0, 0, 2)


def test_a_cancelled_or_aborted_run_frees_its_blocks_once() -> None:
    """A run cancelled while it plays (its caller gone, a CancelRun) and a run whose
    stream breaks (an abort) free their blocks when they end, exactly once: while the
    first hangs its blocks are in use (Describe's `kv_cache_used_tokens`), after it
    nothing is, and the blocks stay cached."""
    node, cache = _node()

    async def scenario() -> list[int]:
        used = []
        hang = [{"type": "delta", "delta": "x" * 400}, {"type": "hang"}]
        run, stream, request = _run(hang, [1, 2])
        task = asyncio.create_task(node.play(run, request, None))
        async with asyncio.timeout(10):
            await stream.some.wait()
        # 2 blocks, and (100 characters + 400 of answer) / 4 = 125 tokens: 2 of its own.
        used.append(cache.in_use)
        used.append((await node.describe(pb.DescribeRequest())).kv_cache_used_tokens or 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        used.append(cache.in_use)
        aborted, _, request = _run([{"type": "delta", "delta": "y"}, {"type": "abort"}], [1, 3])
        with pytest.raises(GRPCError):
            await node.play(aborted, request, None)
        used.append(cache.in_use)
        return used

    assert asyncio.run(scenario()) == [4, 4 * BLOCK_TOKENS, 0, 0]
    assert cache.pinned == 0
    assert (cache.match([1, 2]), cache.match([1, 3])) == (2, 2)
    assert not node._leases


def test_a_script_that_fails_before_its_prefill_holds_nothing() -> None:
    """A script the node cannot play is refused before its prefill: it takes no block."""
    node, cache = _node()
    run, _, request = _run([], [1, 2])
    request.messages[0].content = "no script here"
    assert asyncio.run(node.play(run, request, None)) == "error"
    assert (cache.in_use, cache.held) == (0, 0)


def test_a_repeated_delta_counts_each_of_its_sends() -> None:
    """A delta sent `repeat` times (the benchmarks' fast path) takes the blocks of its
    answer as the same deltas sent one by one do, while the run plays."""

    async def in_use(events: list[dict[str, Any]]) -> int:
        node, cache = _node()
        run, stream, request = _run([*events, {"type": "hang"}], [1, 2])
        task = asyncio.create_task(node.play(run, request, None))
        async with asyncio.timeout(10):
            while len(stream.sent) < 3:
                stream.some.clear()
                await stream.some.wait()
        used = cache.in_use
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return used

    delta = {"type": "delta", "delta": "x" * (2 * BLOCK_TOKENS * 4)}  # two blocks' tokens
    repeated = asyncio.run(in_use([{**delta, "repeat": 3}]))
    one_by_one = asyncio.run(in_use([delta, delta, delta]))
    # Its 2 prompt blocks pinned; its prompt's 153 tokens and its answer's 384 take 9
    # blocks: 7 of its own.
    assert repeated == one_by_one == 2 + 7
