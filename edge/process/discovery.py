"""Nodes found by DNS: the `[[nodes]]` entries with `discover`, looked up again and again.

`Discovery` keeps each discover entry's last answer (its nodes' addresses, `Found`:
`edge.process.resolver`) and turns the entries of a configuration into the nodes they
stand for (`nodes`): an entry with an address is its own node; a discover entry is one
node per address of its last answer, named `NAME/HOST:PORT` (the entry's name, then the
address), with the entry's other settings (token, TLS, max_runs; with TLS and no
`server_name`, the certificate must carry the name the address was found under). A node
keeps its name, and so its state in the pool (breaker, load, cache index, gauges), for
as long as its address stays in the answers.

The names are looked up at start (before the nodes open), at each reload (before it
applies: `edge.process.reload`), and every `discover_interval_s` by `Discovery.run`,
which then makes the pool's nodes those of the answers as a reload does
(`NodeSet.changed`, then `NodeSet.switch`): a node that appeared joins the pool and takes
no run before it answered (a dead address never does); a node gone from the answer leaves
the pool, takes no new run, and closes once its runs are over. A look-up that fails
keeps the entry's last answer, so a DNS outage never empties the fleet: logged when it
begins to fail and when it answers again, counted every time
(`iop_edge_discovery_errors_total{entry, reason}`); an entry that never answered has no
node yet.

The nodes change under `NodeSet.lock`, which a reload holds too, from its look-ups to
its new snapshot: a round of discovery never applies answers to a configuration a reload
has replaced. Knows nothing of DNS messages (the resolver's) nor of requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import trio
from loguru import logger

from edge.config import Config, DiscoveryConfig, NodeConfig
from edge.config.address import Discover, parse_discover
from edge.fleet.pool import NodePool
from edge.fleet.runs import Runs
from edge.http.live import Snapshots
from edge.observe.logbound import clip
from edge.process.nodeset import NodeSet
from edge.process.resolver import MAX_FOUND, Found, LookupFailed, Resolver

# A discover entry, as its answers are kept: its name and its DNS name (a reload that
# changes either starts it afresh; one that changes its other settings keeps its answer).
Key = tuple[str, str]
# Hears each failed look-up: (entry name, reason).
OnError = Callable[[str, str], object]


def _key(entry: NodeConfig) -> Key:
    return (entry.name, entry.discover or "")


def node_of(entry: NodeConfig, found: Found) -> NodeConfig:
    """The node of the discover entry `entry` at the address `found`."""
    server_name = entry.server_name
    if entry.tls and server_name is None:
        server_name = found.target
    return replace(
        entry,
        name=f"{entry.name}/{found.address}",
        address=found.address,
        discover=None,
        server_name=server_name,
    )


class Discovery:
    """The answers of the discover entries, and the task that keeps them current (see the
    module doc). `open` it: its resolver reads the system's configuration off the loop."""

    def __init__(self, resolver: Resolver, on_error: OnError) -> None:
        self._resolver = resolver
        self._on_error = on_error
        self._answers: dict[Key, tuple[Found, ...]] = {}
        # When each entry is looked up next (trio's clock).
        self._due: dict[Key, float] = {}
        # The entries whose last look-up failed (logged once, when it began).
        self._failing: set[Key] = set()
        self._wake = trio.Event()

    @classmethod
    async def open(cls, settings: DiscoveryConfig, on_error: OnError) -> Discovery:
        return cls(await trio.to_thread.run_sync(Resolver, settings), on_error)

    async def configure(self, settings: DiscoveryConfig) -> None:
        """A reload's `[discovery]`: the look-ups from now on ask as it says."""
        if settings != self._resolver.settings:
            self._resolver = await trio.to_thread.run_sync(Resolver, settings)

    def wake(self) -> None:
        """The configuration changed: the next look-ups are those of its entries."""
        self._wake.set()

    def nodes(self, entries: Sequence[NodeConfig]) -> list[NodeConfig]:
        """The nodes `entries` stand for, in their order (see the module doc); a node found
        under a name another node has already is left out."""
        out: list[NodeConfig] = []
        names = {entry.name for entry in entries if not entry.discovered}
        for entry in entries:
            if not entry.discovered:
                out.append(entry)
                continue
            for found in self._answers.get(_key(entry), ()):
                node = node_of(entry, found)
                if node.name not in names:
                    names.add(node.name)
                    out.append(node)
        return out

    async def resolve(self, entries: Sequence[NodeConfig], *, due_only: bool = False) -> None:
        """Look up the DNS name of each discover entry of `entries` (with `due_only`, those
        whose interval has passed), all at once; each answer kept, each failure counted."""
        now = trio.current_time()
        wanted = [
            entry for entry in entries
            if entry.discovered and (not due_only or self._due.get(_key(entry), -math.inf) <= now)
        ]  # fmt: skip
        if not wanted:
            return
        async with trio.open_nursery() as nursery:
            for entry in wanted:
                nursery.start_soon(self._lookup, entry, parse_discover(entry.discover or ""))

    async def _lookup(self, entry: NodeConfig, discover: Discover) -> None:
        key = _key(entry)
        self._due[key] = trio.current_time() + entry.discover_interval_s
        try:
            found = await self._resolver.lookup(discover)
        except LookupFailed as exc:
            self._on_error(entry.name, exc.reason)
            if key not in self._failing:
                self._failing.add(key)
                kept = len(self._answers.get(key, ()))
                stay = f"the last answer's {kept} node(s) stay" if kept else "no node yet"
                logger.warning(
                    "nodes of {} ({}): the look-up failed ({}: {}); {}",
                    entry.name, entry.discover, exc.reason, clip(str(exc)), stay,
                )  # fmt: skip
            return
        if key in self._failing:
            self._failing.discard(key)
            logger.info("nodes of {} ({}): the look-up answers again", entry.name, entry.discover)
        if len(found) == MAX_FOUND and len(self._answers.get(key, ())) != MAX_FOUND:
            logger.warning(
                "nodes of {} ({}): the name gives {} addresses or more; the first {} are"
                " nodes, the rest are left out",
                entry.name, entry.discover, MAX_FOUND, MAX_FOUND,
            )  # fmt: skip
        self._answers[key] = tuple(found)

    def _forget(self, entries: Sequence[NodeConfig]) -> None:
        """The answers of entries no longer in the configuration are dropped."""
        keep = {_key(entry) for entry in entries if entry.discovered}
        for key in [key for key in self._due if key not in keep]:
            self._answers.pop(key, None)
            self._due.pop(key, None)
            self._failing.discard(key)

    def _next_due(self, entries: Sequence[NodeConfig]) -> float:
        due = (self._due.get(_key(e), -math.inf) for e in entries if e.discovered)
        return min(due, default=math.inf)

    async def run(
        self,
        snapshots: Snapshots,
        nodes: NodeSet,
        pool: NodePool,
        runs: Runs,
        nursery: trio.Nursery,
    ) -> None:
        """Forever: each entry of the configuration in use looked up when its interval has
        passed, and the pool's nodes made those of the answers (nodes removed close in
        `nursery` once their runs are over)."""
        while True:
            with trio.move_on_at(self._next_due(snapshots.current.config.nodes)):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                async with nodes.lock:
                    config = snapshots.current.config
                    await self.resolve(config.nodes, due_only=True)
                    self._forget(config.nodes)
                    await self._apply(config, nodes, pool, runs, nursery)
            except Exception as exc:  # a bug: logged, the nodes stay as they are
                logger.opt(exception=exc).error("nodes found by DNS: {}", clip(str(exc)))

    async def _apply(
        self, config: Config, nodes: NodeSet, pool: NodePool, runs: Runs, nursery: trio.Nursery
    ) -> None:
        """The pool's nodes made those of `config`'s entries and their answers."""
        wanted = self.nodes(config.nodes)
        try:
            added, removed = await nodes.changed(wanted)
        except Exception as exc:  # a node's token or certificate files gone since read
            logger.error("nodes found by DNS: cannot open a node: {}", clip(str(exc)))
            return
        if not added and not removed:
            return
        await nodes.switch(added, removed, wanted, pool, runs, nursery, config.timeouts.total_s)
        logger.info(
            "nodes found by DNS: {} joined, {} leaving; {} node(s) in all",
            len(added), len(removed), len(nodes.open),
        )  # fmt: skip
