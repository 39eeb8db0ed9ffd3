"""The KV block log a node's watchers report from (`edge.nodes.blocklog`): each watcher's
position, the snapshot on its first report and when it fell behind, each block's net
change once, and the bounds of the ring and of a report.

Pure: a log over a set this test holds, no node.
"""

from __future__ import annotations

import pytest

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import MAX_KV_BLOCKS_PER_REPORT
from edge.nodes.blocklog import MIN_RING, BlockLog, ring_size


class Held:
    """A set of blocks (insertion ordered) and its log, changed the way a cache would."""

    def __init__(self, capacity: int) -> None:
        self.blocks: dict[int, None] = {}
        self.log = BlockLog(capacity, self.blocks.keys)

    def store(self, *blocks: int) -> None:
        for block in blocks:
            self.blocks[block] = None
            self.log.stored(block)

    def evict(self, *blocks: int) -> None:
        for block in blocks:
            del self.blocks[block]
            self.log.evicted(block)


def _report(log: BlockLog, position: int | None) -> tuple[pb.DescribeResponse, int]:
    report = pb.DescribeResponse()
    return report, log.report(report, position)


def test_a_watchers_first_report_is_a_snapshot_then_changes_since_its_last() -> None:
    """The first report holds the whole set (kv_blocks_snapshot), in the order held; each
    later one the blocks stored and evicted since the watcher's previous report."""
    held = Held(64)
    held.store(1, 2, 3)
    first, position = _report(held.log, None)
    assert first.kv_blocks_snapshot
    assert (list(first.kv_blocks_stored), list(first.kv_blocks_evicted)) == ([1, 2, 3], [])
    held.store(4)
    held.evict(1)
    second, position = _report(held.log, position)
    assert not second.kv_blocks_snapshot
    assert (list(second.kv_blocks_stored), list(second.kv_blocks_evicted)) == ([4], [1])
    third, _ = _report(held.log, position)
    assert (list(third.kv_blocks_stored), list(third.kv_blocks_evicted)) == ([], [])


def test_each_watcher_reads_from_its_own_position() -> None:
    """Two watchers reading at different times each get what they have not been told, from
    the one log (a watcher is a position, not a copy)."""
    held = Held(64)
    _, fast = _report(held.log, None)
    _, slow = _report(held.log, None)
    held.store(1)
    report, fast = _report(held.log, fast)
    assert list(report.kv_blocks_stored) == [1]
    held.store(2)
    report, fast = _report(held.log, fast)
    assert list(report.kv_blocks_stored) == [2]
    report, slow = _report(held.log, slow)
    assert list(report.kv_blocks_stored) == [1, 2]
    assert fast == slow == held.log.end


def test_each_block_is_reported_once_as_its_last_event_left_it() -> None:
    """Within one report's period a block stored then evicted is reported evicted only, and
    one evicted then stored again is reported stored only: applying the stored blocks
    then the evicted ones (the contract's order), or the other way, gives the set held."""
    held = Held(64)
    held.store(1)
    _, position = _report(held.log, None)
    held.store(2)
    held.evict(2)  # stored then evicted
    held.evict(1)
    held.store(1)  # evicted then stored again
    report, _ = _report(held.log, position)
    assert list(report.kv_blocks_stored) == [1]
    assert list(report.kv_blocks_evicted) == [2]
    for order in (("stored", "evicted"), ("evicted", "stored")):
        seen = {1}
        for kind in order:
            if kind == "stored":
                seen.update(report.kv_blocks_stored)
            else:
                seen.difference_update(report.kv_blocks_evicted)
        assert seen == set(held.blocks)


def test_a_watcher_that_fell_behind_the_ring_gets_a_snapshot() -> None:
    """A watcher more events behind than the ring keeps gets the whole set again (no
    larger than the changes it missed), then changes from there; one exactly a ring
    behind still gets the changes."""
    held = Held(8)
    assert held.log.size == MIN_RING
    _, behind = _report(held.log, None)
    _, level = _report(held.log, None)
    held.store(*range(MIN_RING))
    # `level` is exactly MIN_RING events behind: changes; `behind` one more: a snapshot.
    report, level = _report(held.log, level)
    assert not report.kv_blocks_snapshot
    assert set(report.kv_blocks_stored) == set(held.blocks)
    held.store(MIN_RING)
    report, behind = _report(held.log, behind)
    assert report.kv_blocks_snapshot
    assert list(report.kv_blocks_stored) == list(held.blocks)
    assert list(report.kv_blocks_evicted) == []
    held.store(MIN_RING + 1)
    report, behind = _report(held.log, behind)
    assert not report.kv_blocks_snapshot
    assert list(report.kv_blocks_stored) == [MIN_RING + 1]


def test_the_ring_and_a_report_stay_within_their_bounds() -> None:
    """The ring keeps twice the capacity (at least MIN_RING, at most
    MAX_KV_BLOCKS_PER_REPORT events), never fewer events than the cache holds blocks; a
    log refuses a capacity past one report; a report of the largest cache under churn
    carries at most MAX_KV_BLOCKS_PER_REPORT hashes."""
    assert ring_size(0) == MIN_RING
    assert ring_size(10_000) == 20_000
    assert ring_size(MAX_KV_BLOCKS_PER_REPORT) == MAX_KV_BLOCKS_PER_REPORT
    assert all(ring_size(c) >= c for c in (0, 1, 1000, 40_000, MAX_KV_BLOCKS_PER_REPORT))
    with pytest.raises(ValueError, match="blocks"):
        BlockLog(MAX_KV_BLOCKS_PER_REPORT + 1, list)
    held = Held(MAX_KV_BLOCKS_PER_REPORT)
    held.store(*range(MAX_KV_BLOCKS_PER_REPORT))
    _, position = _report(held.log, None)
    sizes = []
    for turn in range(3):
        base = (turn + 1) * MAX_KV_BLOCKS_PER_REPORT
        # Half the cache replaced: as many events as the ring keeps.
        half = MAX_KV_BLOCKS_PER_REPORT // 2
        for i in range(half):
            held.evict(next(iter(held.blocks)))
            held.store(base + i)
        report, position = _report(held.log, position)
        sizes.append(len(report.kv_blocks_stored) + len(report.kv_blocks_evicted))
        assert not report.kv_blocks_snapshot
    held.store(-1 % 2**64)  # the largest fixed64
    report, position = _report(held.log, position)
    assert list(report.kv_blocks_stored) == [2**64 - 1]
    assert max(sizes) <= MAX_KV_BLOCKS_PER_REPORT


def test_after_a_reset_every_watcher_gets_a_snapshot_then_changes_again() -> None:
    """A node that no longer knows what changed (iop-node after a gap in its server's
    events) resets the log: every watcher, however recent its report, gets the set held
    now as a snapshot, and changes from there on."""
    held = Held(8)
    held.store(1, 2)
    _, first = _report(held.log, None)
    _, second = _report(held.log, None)
    held.blocks.clear()
    held.log.reset()
    held.store(3)
    afters = []
    for position in (first, second):
        report, after = _report(held.log, position)
        assert report.kv_blocks_snapshot
        assert report.kv_blocks_stored == [3]
        afters.append(after)
    held.store(4)
    for after in afters:
        report, _ = _report(held.log, after)
        assert not report.kv_blocks_snapshot
        assert report.kv_blocks_stored == [4]
