"""One node as the pool sees it (`NodeState`), and how what a node says of itself
updates it: its cap on runs (`max_runs_of`), its cache index from a Watch report's
KV block events (`kv_events`).

The pool (`edge.fleet.pool`) holds one `NodeState` per node and picks among them;
the run side counts its runs in flight on it. Nothing here does I/O.
"""

from __future__ import annotations

import math

import trio

from edge.contract.prefix import BLOCK_TOKENS
from edge.fleet import load
from edge.fleet.cacheindex import MAX_BLOCKS, CacheIndex
from edge.fleet.health import HealthPolicy, NodeHealth
from edge.fleet.load import NodeLoad
from edge.node.client import NodeClient, NodeDescription


class NodeState:
    """One node as the pool sees it: client, models, health, runs in flight and its cap.

    Compared by identity (a set of the nodes a run tried holds these).
    """

    __slots__ = (
        "at_report",
        "cache",
        "client",
        "configured_max_runs",
        "continuation_models",
        "describing",
        "description",
        "health",
        "in_flight",
        "kick",
        "load",
        "logprobs_models",
        "max_runs",
        "models",
        "polled",
        "probed",
        "retired",
        "watch_scope",
        "watching",
    )

    def __init__(
        self,
        client: NodeClient,
        health: NodeHealth | None = None,
        *,
        max_runs: int | None = None,
        cache_blocks: int = 1,
    ) -> None:
        self.client = client
        # The prefix blocks its KV cache holds, as far as this edge knows (cache_aware).
        self.cache = CacheIndex(cache_blocks)
        self.health = health if health is not None else NodeHealth(HealthPolicy())
        self.models: tuple[str, ...] = ()
        # The models it gives token logprobs for (a node older than the field: none).
        self.logprobs_models: frozenset[str] = frozenset()
        # The models it continues an answer of (a node older than the field: none), for
        # a run cut mid-answer elsewhere (`edge.fleet.migration`).
        self.continuation_models: frozenset[str] = frozenset()
        # Runs in flight, counted by the run side (edge.fleet.run).
        self.in_flight = 0
        # [[nodes]] max_runs (0: no limit), None: the node's Describe max_runs.
        self.configured_max_runs = max_runs
        # Runs in flight it takes at once (inf: no limit).
        self.max_runs: float = max_runs_of(max_runs, None)
        self.description: NodeDescription | None = None
        self.describing = False
        # Its load as its last Watch report gave it (None: no report on the stream open
        # now, or the node is polled), and this process's runs on it when it came.
        self.load: NodeLoad | None = None
        self.at_report = 0
        # Asked with Describe: the node answered Watch UNIMPLEMENTED (until it is down
        # and back). Else its watch task (`watching`) keeps its state.
        self.polled = False
        self.watching = False
        # The open subscription (cancelled by a refusal), and what wakes a watch task
        # waiting for its next subscription.
        self.watch_scope: trio.CancelScope | None = None
        self.kick = trio.Event()
        # Its first check concluded (a report, a Describe answer, or a failure of either).
        self.probed = trio.Event()
        # Out of the configuration (a reload): no new runs, its watch task ends; the runs
        # it has finish (`NodePool.remove`).
        self.retired = False

    @property
    def healthy(self) -> bool:
        """Reachable: it answered its last Describe (or run) and refused no run since."""
        return self.health.up

    @property
    def error(self) -> str | None:
        return self.health.reason

    def has_slot(self) -> bool:
        return self.in_flight < self.max_runs

    def rank(self) -> load.Rank:
        """Its place for a new run, lower first (`edge.fleet.load.rank`)."""
        return load.rank(self.load, self.in_flight, self.at_report, self.max_runs)

    def __repr__(self) -> str:
        return f"NodeState({self.client.name!r}, in_flight={self.in_flight})"


def kv_events(cache: CacheIndex, description: NodeDescription) -> None:
    """A Watch report's KV block events into the node's index: a snapshot makes it
    exact and replaces it; stores then evictions apply to an exact index; a stream's
    first report without a snapshot says the node does not track its blocks (any
    more): the index is approximate again."""
    if description.kv_snapshot:
        tokens = description.kv_cache_tokens
        cache.resize(tokens // BLOCK_TOKENS if tokens else MAX_BLOCKS)
        cache.snapshot(description.kv_stored)
    elif cache.exact:
        if description.seq <= 1:
            cache.clear()
            return
        cache.stored(description.kv_stored)
        cache.evicted(description.kv_evicted)


def max_runs_of(configured: int | None, described: NodeDescription | None) -> float:
    if configured is not None:
        return configured or math.inf
    if described is not None and described.max_runs:
        return described.max_runs
    return math.inf
