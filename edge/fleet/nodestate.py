"""One node as the pool sees it (`NodeState`), and how what a node says of itself
updates it: its cap on runs (`max_runs_of`), its cache index from a Watch report's
KV block events (`kv_events`); the nodes one request tried (`Tried`).

The pool (`edge.fleet.pool`) holds one `NodeState` per node and picks among them;
the run side counts its runs in flight on it. Nothing here does I/O.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator

import trio

from edge.contract.prefix import BLOCK_TOKENS
from edge.fleet import load
from edge.fleet.cacheindex import MAX_BLOCKS, CacheIndex
from edge.fleet.health import HealthPolicy, NodeHealth
from edge.fleet.load import NodeLoad
from edge.node.client import NodeClient, NodeDescription

# How many ended lives of a node's process are remembered: more restarts than a
# request's deadline sees.
PAST_INSTANCES = 8


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
        "free_every",
        "freed_at",
        "health",
        "in_flight",
        "kick",
        "load",
        "logprobs_models",
        "max_runs",
        "models",
        "past_instances",
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
        # When a slot of it was last given back while it was full, and the time between
        # two such (smoothed; 0: not known yet): how soon a run waiting for it gets one
        # (`edge.fleet.cachehold`).
        self.freed_at: float | None = None
        self.free_every = 0.0
        # [[nodes]] max_runs (0: no limit), None: the node's Describe max_runs.
        self.configured_max_runs = max_runs
        # Runs in flight it takes at once (inf: no limit).
        self.max_runs: float = max_runs_of(max_runs, None)
        self.description: NodeDescription | None = None
        self.describing = False
        # The lives of its process this edge saw end: instance ids it reported, each
        # replaced by a later one (a restart), the last few (`Tried`).
        self.past_instances: collections.deque[str] = collections.deque(maxlen=PAST_INSTANCES)
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


def kv_events(cache: CacheIndex, description: NodeDescription, tick: int) -> None:
    """A Watch report's KV block events into the node's index: a snapshot makes it
    exact and replaces it; stores then evictions apply to an exact index (the blocks
    stored count in its live demand from this edge's dispatch `tick`: some edge sent
    that traffic); a stream's first report without a snapshot says the node does not
    track its blocks (any more): the index is approximate again."""
    if description.kv_snapshot:
        tokens = description.kv_cache_tokens
        cache.resize(tokens // BLOCK_TOKENS if tokens else MAX_BLOCKS)
        cache.snapshot(description.kv_stored)
    elif cache.exact:
        if description.seq <= 1:
            cache.clear()
            return
        cache.reported(description.kv_stored, description.kv_evicted, tick)


def max_runs_of(configured: int | None, described: NodeDescription | None) -> float:
    if configured is not None:
        return configured or math.inf
    if described is not None and described.max_runs:
        return described.max_runs
    return math.inf


class Tried:
    """The nodes one request tried (a failover, a moved answer), each with the life of
    the node's process its run reached: the instance id the node named in that run's
    accept. A node may take the request again once the edge saw that life end: the
    node reported it, then another one (it restarted, a new process with nothing of
    the request's failure: a rolling restart, an answer whose nodes all died in turn).
    A node whose run got no accept, that names no instance, or whose run reached a
    life the edge has not seen end (a restart it has not heard of yet, or none) stays
    excluded. A collection of the nodes excluded now, as the pool's `exclude` takes it.
    """

    __slots__ = ("_lives",)

    def __init__(self) -> None:
        self._lives: dict[NodeState, str] = {}

    def add(self, node: NodeState, life: str | None = "") -> None:
        """`node` was tried; `life`: the one its run reached ("": unknown; `Run.life`).
        None: its run reached no process of it (the RunRequest was not written), so it
        is not tried: its health keeps it out while it is down."""
        if life is None:
            self._lives.pop(node, None)
        else:
            self._lives[node] = life

    def __contains__(self, node: object) -> bool:
        life = self._lives.get(node)  # type: ignore[call-overload]
        if life is None:
            return False
        assert isinstance(node, NodeState)
        return not life or life not in node.past_instances

    def __iter__(self) -> Iterator[NodeState]:
        return (node for node in self._lives if node in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        """Whether any node is excluded now (the pool's queue asks, per pick): stops at
        the first, where `len` counts them all."""
        return any(True for _ in self)
