"""Chains of KV blocks for the cache models' property tests, and a watcher of their reports.

`Chains` names a path of block contents as the chain of ids the edge's fingerprint
would give it (a block stands for itself and every block before it), and says
whether a cache holds every block's predecessor. `Watcher` applies a `BlockLog`'s
reports (a snapshot, stores, then evictions) to a set of its own, as a node's
watchers do.
"""

from __future__ import annotations

from collections.abc import Sequence

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.blocklog import BlockLog
from edge.nodes.sim.kvcache import KVCache


class Chains:
    """Block ids for paths of contents: equal prefixes, equal ids."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, ...], int] = {}
        self._parent: dict[int, int] = {}

    def chain(self, path: Sequence[int]) -> list[int]:
        """The chain of block ids of `path`, its first block first."""
        chain: list[int] = []
        for i in range(len(path)):
            block = self._ids.setdefault(tuple(path[: i + 1]), len(self._ids) + 1)
            if i:
                self._parent[block] = chain[-1]
            chain.append(block)
        return chain

    def unbroken(self, cache: KVCache) -> bool:
        """Whether every block `cache` holds has the block before it held too."""
        parent = self._parent
        return all(block not in parent or parent[block] in cache for block in cache.blocks())


class Watcher:
    """A node's watcher: the blocks it believes held, from `log`'s reports."""

    def __init__(self, log: BlockLog) -> None:
        self._log = log
        self._position: int | None = None
        self.seen: set[int] = set()

    def read(self) -> None:
        """Apply the report since the last one read."""
        report = pb.DescribeResponse()
        self._position = self._log.report(report, self._position)
        if report.kv_blocks_snapshot:
            self.seen.clear()
        self.seen.update(report.kv_blocks_stored)
        self.seen.difference_update(report.kv_blocks_evicted)
