"""Reloading the configuration (SIGHUP) while the edge serves, with nothing in flight noticing.

`Reloads` holds the reload asked for (a SIGHUP, or a worker's supervisor
naming the file it checked); asks that come while one is applied make one
more reload, not one each. `Reloader.run` applies them one at a time:

1. The file is read and checked whole, off the loop (it may name key
   files). A mistake refuses the reload with the configuration's own message
   (file and key), in one log line, and counts it
   (`iop_edge_config_reloads_total{result="error"}`): nothing changes. A
   worker reads the copy its supervisor checked (`edge.process.supervisor`,
   `config_copy`) and checks its digest: every worker switches to the same
   bytes, whatever happens to the file meanwhile.
2. The settings bound at start (`edge.config.reload.RESTART_ONLY`) keep their
   running values and are named in the log line; the rest applies.
3. The DNS names of the entries with `discover` are looked up at once
   (`edge.process.discovery`; one that fails keeps its last answer), the next
   snapshot is built (`build_snapshot`: keys, limiter, failover), and the nodes
   added are opened (an embedded one started). A failure here refuses the reload
   as a mistake does.
4. The nodes added join the pool and the reload waits for their first answer
   (or failure, at most `edge.process.nodeset.PROBE_WAIT_S`); then, with no wait in
   between, the nodes removed leave it (`NodeSet.switch`), the pool takes the new routing,
   the admission queue its bounds, the log its level, tracing its sample
   ratio, and the snapshot is swapped in. Requests that arrived before keep theirs
   (`edge.http.live`). The log line names what changed, and
   `iop_edge_config_info` the digest this process runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import trio
from loguru import logger

from edge.config import Config, ConfigError, LimitsConfig, LoadedConfig
from edge.config.reload import applied, changes, restart_needed
from edge.fleet.admission import Admission
from edge.fleet.failover import Failover
from edge.fleet.pool import NodePool
from edge.fleet.runs import Runs
from edge.http.cors import Cors
from edge.http.live import Snapshot, Snapshots
from edge.limits.limiter import KeyRing, Limiter
from edge.limits.stores import open_limiter
from edge.observe.log import set_level
from edge.observe.logbound import clip
from edge.observe.metrics import EdgeMetrics
from edge.observe.tracing import Tracing
from edge.process.discovery import Discovery
from edge.process.nodeset import NodeSet, OpenNode
from edge.process.supervisor import read_copy

# Reads the configuration as the command line does (its flags on top): from its file,
# or (a worker) from the bytes of the supervisor's copy of it and of the files it names:
# `load(None)`, `load(data, files)`.
Loader = Callable[..., LoadedConfig]


class Reloads:
    """The reload asked for and not yet begun: the digest a supervisor checked (a
    worker's), or None (read the file); a new ask replaces one still waiting."""

    def __init__(self) -> None:
        self._pending: list[str | None] = []
        self._asked = trio.Event()

    def ask(self, digest: str | None = None) -> None:
        self._pending = [digest]
        self._asked.set()

    async def next(self) -> str | None:
        await self._asked.wait()
        self._asked = trio.Event()
        return self._pending.pop()


class LimiterKeeper:
    """The limiter of the keys with limits: opened when a key first has limits (at start,
    or in a reload), on the store `[limits]` chose at start, and kept to the end; a
    reload's keys are told to its store (`Limiter.rekey`)."""

    def __init__(
        self,
        settings: LimitsConfig,
        metrics: EdgeMetrics,
        shared_dir: Path | None,
        stack: AsyncExitStack,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._shared_dir = shared_dir
        self._stack = stack
        self._limiter: Limiter | None = None

    def for_keys(self, keys: KeyRing) -> Limiter | None:
        """The limiter of `keys` (None when none has limits): the one already open, its
        store told of them, or a new one (closed at the end of the stack)."""
        if not any(k.limited for k in keys.keys):
            return None
        if self._limiter is not None:
            self._limiter.rekey(keys)
            return self._limiter
        limiter = open_limiter(keys, self._settings, self._metrics, shared_dir=self._shared_dir)
        if limiter is not None:
            self._stack.push_async_callback(limiter.aclose)
            self._limiter = limiter
        return limiter


def build_snapshot(config: Config, digest: str, runs: Runs, limits: LimiterKeeper) -> Snapshot:
    """What the requests arriving under `config` use of it, built once."""
    keys = KeyRing(config.keys, config.server.api_keys)
    failover = Failover(runs, config.routing, config.timeouts)
    cors = Cors(config.server.cors_allow_origins)
    return Snapshot(config, keys, limits.for_keys(keys), failover, cors, digest, time.time())


@dataclass(eq=False)
class Reloader:
    """Applies reloads to one edge process (see the module doc)."""

    # The configuration the process started with: what RESTART_ONLY keeps.
    running: Config
    load: Loader
    snapshots: Snapshots
    nodes: NodeSet
    pool: NodePool
    admission: Admission
    runs: Runs
    limits: LimiterKeeper
    metrics: EdgeMetrics
    discovery: Discovery
    tracing: Tracing | None = None
    # A worker's: where its supervisor's copies are.
    shared_dir: Path | None = None

    async def run(self, reloads: Reloads, nursery: trio.Nursery) -> None:
        """Apply each reload asked for, one at a time, forever (removed nodes close in
        `nursery` once their runs are over)."""
        while True:
            digest = await reloads.next()
            try:
                await self.reload(digest, nursery)
            except Exception as exc:  # a bug: logged, the edge serves on as it was
                logger.opt(exception=exc).error("reload failed: {}", clip(str(exc)))
                self.metrics.config_reloads.labels("error").inc()

    def _read(self, digest: str | None) -> LoadedConfig:
        """The configuration to apply (in a worker thread): the file, or the copy of it
        the supervisor checked (whose digest must be `digest`)."""
        if digest is None or self.shared_dir is None:
            return self.load(None)
        return self.load(*read_copy(self.shared_dir, digest))

    async def reload(self, digest: str | None, nursery: trio.Nursery) -> bool:
        """Read, check and apply the configuration; False: refused, nothing changed."""
        current = self.snapshots.current
        try:
            loaded = await trio.to_thread.run_sync(self._read, digest)
        except ConfigError as exc:
            return self._refused(current, str(exc))
        new = applied(self.running, loaded.config)
        async with self.nodes.lock:
            snapshot = await self._switch(current, loaded, new, nursery)
        if snapshot is None:
            return False
        self.discovery.wake()
        what = ", ".join(changes(current.config, new)) or "nothing changed"
        restart = restart_needed(self.running, loaded.config)
        line = logger.bind(config=new.source, digest=snapshot.digest, previous=current.digest)
        if restart:
            line.warning(
                "configuration reloaded from {} ({}): {}; needs a restart to apply (the"
                " running values stay): {}",
                new.source, snapshot.digest, what, ", ".join(restart),
            )  # fmt: skip
        else:
            line.info("configuration reloaded from {} ({}): {}", new.source, snapshot.digest, what)
        return True

    async def _switch(
        self, current: Snapshot, loaded: LoadedConfig, new: Config, nursery: trio.Nursery
    ) -> Snapshot | None:
        """The nodes, the settings and the snapshot of `new` (under the node set's lock);
        None: refused, nothing changed."""
        added: list[OpenNode] = []
        try:
            await self.discovery.configure(new.discovery)
            await self.discovery.resolve(new.nodes)
            wanted = self.discovery.nodes(new.nodes)
            added, removed = await self.nodes.changed(wanted)
            snapshot = build_snapshot(new, loaded.digest, self.runs, self.limits)
        except Exception as exc:  # a node that cannot start, a store that cannot open
            with trio.CancelScope(shield=True):
                for opened in added:
                    await opened.stack.aclose()
            self._refused(current, f"{new.source}: {exc}")
            await self.discovery.configure(current.config.discovery)
            return None
        longest_run_s = max(current.config.timeouts.total_s, new.timeouts.total_s)
        await self.nodes.switch(
            added, removed, wanted, self.pool, self.runs, nursery, longest_run_s
        )
        self.pool.configure(new.routing, new.server.node_refresh_s)
        self.admission.configure(new.admission)
        set_level(new.log.level)
        if self.tracing is not None:
            self.tracing.adjust(new.tracing)
        self.snapshots.swap(snapshot)
        self.metrics.config_loaded(snapshot.digest, snapshot.loaded_at)
        self.metrics.config_reloads.labels("ok").inc()
        return snapshot

    def _refused(self, current: Snapshot, why: str) -> bool:
        self.metrics.config_reloads.labels("error").inc()
        logger.bind(digest=current.digest).error(
            "reload refused, the configuration in use ({}) stays: {}", current.digest, clip(why)
        )
        return False
