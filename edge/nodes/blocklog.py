"""The KV block reports of a Watch stream (`DescribeResponse.kv_blocks_*`): what a node
that keeps its KV cache by the edge's prefix blocks (`RunRequest.prefix_blocks`) tells
each watcher it stored and evicted.

`BlockLog` is the node's one record of those changes: a ring of its last
events (a block stored, or evicted), numbered from 0 in the order they
happened. A watcher keeps only its position in that numbering (the first
event it has not been told of); `BlockLog.report` fills one report from there
and returns the watcher's new position. The log costs its ring whatever the
number of watchers (no watcher has a copy of it), and a report costs the
events it carries.

What a report holds:
- The changes since the watcher's previous report, each block once, as its
  last event left it: a block last stored is in `kv_blocks_stored`, one last
  evicted in `kv_blocks_evicted`. A block stored and evicted within one
  report's period is in `kv_blocks_evicted` only; one evicted and stored
  again, in `kv_blocks_stored` only. So the contract's order rule (the edge
  applies the stored blocks, then the evicted ones) leaves the edge with the
  set the node holds, as would the other order.
- A snapshot (`kv_blocks_snapshot`): the whole set held now in
  `kv_blocks_stored`, least recently used first. On the watcher's first
  report, when it fell behind by more events than the ring keeps (the ring
  keeps at least as many events as the cache holds blocks, so the snapshot is
  then no larger), and after `reset`: a node that no longer knows what changed
  (iop-node after a gap in its server's events) says what it holds instead.

Bounds: a node holds at most MAX_KV_BLOCKS_PER_REPORT blocks (so a snapshot
fits one report), and the ring keeps min(MAX_KV_BLOCKS_PER_REPORT,
max(2 x capacity, MIN_RING)) events (9 bytes each: 576 KiB at most), at
least the capacity; so a report carries at most MAX_KV_BLOCKS_PER_REPORT
hashes (512 KiB, within the 4 MiB message limit).

Pure: no asyncio, no gRPC stream.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import MAX_KV_BLOCKS_PER_REPORT

# The ring of a small cache keeps this many events at least (a watcher a few runs
# behind still gets changes, not a snapshot).
MIN_RING = 1024


def ring_size(capacity: int) -> int:
    """The events a log of a cache of `capacity` blocks keeps."""
    return min(MAX_KV_BLOCKS_PER_REPORT, max(2 * capacity, MIN_RING))


class BlockLog:
    """The block events of one node's cache, for its watchers (the module says how).

    `held` answers the blocks the cache holds now, least recently used first
    (a snapshot); the cache calls `stored` and `evicted` as it changes.
    """

    __slots__ = ("_evicted", "_hashes", "_held", "end", "size")

    def __init__(self, capacity: int, held: Callable[[], Iterable[int]]) -> None:
        if not 0 <= capacity <= MAX_KV_BLOCKS_PER_REPORT:
            raise ValueError(
                f"a cache whose blocks are reported holds 0 to {MAX_KV_BLOCKS_PER_REPORT}"
                f" blocks, not {capacity}"
            )
        self.size = ring_size(capacity)
        self._held = held
        # Event n is at n % size: its block, and whether it was an eviction.
        self._hashes = array("Q", [0]) * self.size
        self._evicted = bytearray(self.size)
        # The number of events recorded so far (the position after the last one).
        self.end = 0

    def stored(self, block: int) -> None:
        self._record(block, 0)

    def evicted(self, block: int) -> None:
        self._record(block, 1)

    def reset(self) -> None:
        """Every watcher's next report is a snapshot, whatever its position: the node's
        set changed in ways the log does not hold."""
        self.end += self.size + 1

    def _record(self, block: int, evicted: int) -> None:
        at = self.end % self.size
        self._hashes[at] = block
        self._evicted[at] = evicted
        self.end += 1

    def report(self, report: pb.DescribeResponse, position: int | None) -> int:
        """Fill `report` for a watcher at `position` (None: its first report); returns
        its position after this report.

        The changes since `position`, or a snapshot when this is the watcher's
        first report or the ring no longer holds them; linear in what it carries.
        """
        end = self.end
        if position is None or not 0 <= end - position <= self.size:
            report.kv_blocks_stored = list(self._held())
            report.kv_blocks_evicted = []
            report.kv_blocks_snapshot = True
            return end
        last: dict[int, int] = {}
        hashes, evicted, size = self._hashes, self._evicted, self.size
        for n in range(position, end):
            block = hashes[n % size]
            last.pop(block, None)  # ordered by each block's last event
            last[block] = evicted[n % size]
        report.kv_blocks_stored = [block for block, gone in last.items() if not gone]
        report.kv_blocks_evicted = [block for block, gone in last.items() if gone]
        report.kv_blocks_snapshot = False
        return end
