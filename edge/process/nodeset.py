"""The node connections of one edge process, opened from `[[nodes]]` and changed by reloads.

Owns, per configured node, its client (`GrpcNodeClient`; `DirectUpstreamClient`
for an `openai+http://` node, whose runs skip gRPC) and what serves it in
this process when it is embedded (the simulated node, or iop-node in front of a
model server), each node in an exit stack of its own, so that one node can be
closed while the others serve. `open_node` makes a node's client (and starts its
embedded server, on a Unix socket in a directory of its own under `run_dir`, reached
by path: `edge.nodes.embedded`); `changed` (the nodes to add, opened, and those to remove)
then `switch` make the pool's nodes those of a new `[[nodes]]`, or of a new DNS answer
(`edge.process.discovery`: both change them under `lock`, one at a time):

- a node in both, at the same address, stays the same object in the pool:
  its breaker, load, cache index and connection carry over; a new `max_runs`
  applies at once;
- a node added joins the pool, which subscribes to it at once: it takes no
  run before it answered (it serves no model until then);
- a node removed leaves the pool once the nodes added answered (or failed to, at most
  PROBE_WAIT_S): no new run from then on, not even a queued request's; its
  runs in flight finish (bounded by the longest a run may last), then its
  connection closes and its embedded server stops.

A node whose address or credentials changed (its token or TLS settings, or what
their files hold) is the old one removed and a new one added. A node reached over
the network with neither TLS nor a token is named in a warning when it opens.
Knows nothing of requests; the pool decides nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio
from loguru import logger

from edge.config import ConfigError, NodeConfig, split_address, upstream_url
from edge.config.address import is_loopback
from edge.fleet import readiness
from edge.fleet.migration import CANCEL_WAIT_S
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.fleet.runs import Runs
from edge.node.access import NodeAccess, client_ssl_context
from edge.node.backlog import Backlog
from edge.node.client import GrpcNodeClient, NodeClient, NodeSocket
from edge.nodes.direct import DirectUpstreamClient
from edge.nodes.embedded import embedded_node, embedded_upstream_node
from edge.observe.metrics import EdgeMetrics
from edge.observe.tracing import Tracing

# How long a change of the nodes waits for the nodes it adds to answer (or fail to) before
# the nodes it removes leave.
PROBE_WAIT_S = 5.0


@dataclass(eq=False)
class OpenNode:
    """One configured node: its settings, client, embedded server (if any) and stack."""

    config: NodeConfig
    client: NodeClient
    stack: AsyncExitStack
    embedded: object | None = None
    state: NodeState | None = None  # once in the pool


@dataclass(eq=False)
class NodeSet:
    """Every node this process has open (see the module doc)."""

    metrics: EdgeMetrics
    backlog: Backlog
    tracing: Tracing | None = None
    runs_log: Path | None = None
    # Where the sockets of the nodes served in this process go (each in a directory of
    # its own, see `edge.nodes.embedded`); None: the system's temporary directory.
    run_dir: Path | None = None
    # By name: the nodes of the configuration in use.
    open: dict[str, OpenNode] = field(default_factory=dict)
    # Removed from the configuration, their runs finishing.
    leaving: set[OpenNode] = field(default_factory=set)
    # Held while the nodes change (`changed` to `switch`): by a reload, or a round of
    # discovery.
    lock: trio.Lock = field(default_factory=trio.Lock)

    @property
    def embedded(self) -> list[object]:
        return [n.embedded for n in self.open.values() if n.embedded is not None]

    async def open_node(self, node: NodeConfig) -> OpenNode:
        """`node`'s client, its embedded server started first when it has one."""
        metrics = self.metrics
        kind: Callable[..., NodeClient] = GrpcNodeClient
        stack = AsyncExitStack()
        try:
            embedded: object | None = None
            where: NodeSocket
            if node.embedded:
                embedded, where = await stack.enter_async_context(
                    embedded_node(
                        node.name, self.runs_log, tracing=self.tracing, run_dir=self.run_dir
                    )
                )
            elif (url := upstream_url(node.address)) is not None:
                upstream, where = await stack.enter_async_context(
                    embedded_upstream_node(
                        node.name, url, tracing=self.tracing, run_dir=self.run_dir
                    )
                )
                embedded = upstream
                # Its runs go straight to the model server; its state is iop-node's.
                kind = partial(DirectUpstreamClient, node=upstream, tracing=self.tracing)
            else:
                host, port = split_address(node.address)
                where = NodeSocket.tcp(host, port)
                access = node_access(node)
                kind = partial(GrpcNodeClient, access=access)
                if not access.locked and not is_loopback(host):
                    logger.warning(
                        "node {} ({}) is reached over the network with neither TLS nor a"
                        " token: anyone who reaches its port runs its models (set tls and"
                        " token_file in its [[nodes]] entry)",
                        node.name, node.address,
                    )  # fmt: skip
            client = kind(
                node.name, where, on_cancel_sent=metrics.node_cancels.labels(node.name).inc,
                backlog=self.backlog, on_state_rpc=partial(_count_state_rpc, metrics, node.name),
            )  # fmt: skip
            opened = OpenNode(node, client, stack, embedded)
        except BaseException:
            with trio.CancelScope(shield=True):
                await stack.aclose()
            raise
        stack.push_async_callback(opened.client.aclose)
        return opened

    async def open_all(self, nodes: Sequence[NodeConfig]) -> list[OpenNode]:
        """The nodes of the configuration at start, in its order."""
        for node in nodes:
            self.open[node.name] = await self.open_node(node)
        return list(self.open.values())

    def watch(self, pool: NodePool, opened: OpenNode, state: NodeState) -> None:
        """`state` is `opened`'s node in the pool: its gauges read from there."""
        opened.state = state
        name = opened.config.name
        self.metrics.watch_nodes([(name, partial(readiness.state_value, pool, state))])
        self.metrics.watch_node_load([(name, partial(readiness.load_values, state))])

    async def changed(self, nodes: Sequence[NodeConfig]) -> tuple[list[OpenNode], list[str]]:
        """The first half of `apply`, the one that may fail: the nodes of `nodes` to add,
        opened (none if one fails: it raises), and the names of those to remove."""
        wanted = {n.name: n for n in nodes}
        removed = [
            name for name, o in self.open.items()
            if name not in wanted or wanted[name].connection != o.config.connection
        ]  # fmt: skip
        added: list[OpenNode] = []
        try:
            for node in nodes:
                current = self.open.get(node.name)
                if current is None or current.config.connection != node.connection:
                    added.append(await self.open_node(node))
        except BaseException:
            with trio.CancelScope(shield=True):
                for opened in added:
                    await opened.stack.aclose()
            raise
        return added, removed

    async def switch(
        self,
        added: list[OpenNode],
        removed: list[str],
        nodes: Sequence[NodeConfig],
        pool: NodePool,
        runs: Runs,
        nursery: trio.Nursery,
        longest_run_s: float,
    ) -> None:
        """The second half: the nodes `changed` opened join the pool, and once they answered
        (at most PROBE_WAIT_S), with no wait in between, the nodes `removed` leave it (and
        close in `nursery` once their runs are over) and the others take `nodes`' settings.
        Nodes added answer before those removed leave: a node replaced by another has no
        moment with no node for its models."""
        leaving = self.leave(removed)
        joined = self.join(added, pool)
        with trio.move_on_after(PROBE_WAIT_S):
            for state in joined:
                await state.probed.wait()
        self.apply(nodes, leaving, pool, runs, nursery, longest_run_s)

    def join(self, added: list[OpenNode], pool: NodePool) -> list[NodeState]:
        """The nodes `changed` opened join the pool (and its gauges); their states, whose
        `probed` is set once each answered (or failed to)."""
        states = []
        for opened in added:
            name = opened.config.name
            self.open[name] = opened
            state = pool.add(opened.client, opened.config.max_runs)
            self.watch(pool, opened, state)
            states.append(state)
            logger.info("node {} ({}) added", name, opened.client.address)
        return states

    def apply(
        self,
        nodes: Sequence[NodeConfig],
        removed: list[OpenNode],
        pool: NodePool,
        runs: Runs,
        nursery: trio.Nursery,
        longest_run_s: float,
    ) -> None:
        """Make the pool's nodes those of `nodes`, those added having joined: nodes removed
        (`leave` took them out) leave the pool and close in `nursery` once their runs are
        over (at most `longest_run_s` later); the others take their new `max_runs`."""
        for leaving in removed:
            if leaving.state is not None:
                pool.remove(leaving.state)
            nursery.start_soon(self._close_when_idle, leaving, runs, longest_run_s)
        for node in nodes:
            current = self.open[node.name]
            if current.config != node:
                current.config = node
                if current.state is not None:
                    pool.set_max_runs(current.state, node.max_runs)

    def leave(self, removed: list[str]) -> list[OpenNode]:
        """The nodes named `removed`, out of the open ones and their gauges out of the
        scrape (before those added under the same names join); they still serve until
        `apply` takes them out of the pool."""
        leaving = [self.open.pop(name) for name in removed]
        for opened in leaving:
            self.metrics.unwatch_node(opened.config.name)
            self.leaving.add(opened)  # closed at the end whatever happens meanwhile
        return leaving

    async def _close_when_idle(self, leaving: OpenNode, runs: Runs, longest_run_s: float) -> None:
        """A removed node: once its runs are over (or `longest_run_s` passed), its
        connection closed and its embedded server stopped."""
        name = leaving.config.name
        try:
            if leaving.state is not None:
                in_flight = leaving.state.in_flight
                logger.info(
                    "node {} removed: no new runs; closing it once its {} run(s) finish",
                    name, in_flight,
                )  # fmt: skip
                with trio.move_on_after(longest_run_s + CANCEL_WAIT_S):
                    await runs.wait_node_idle(leaving.state)
        finally:
            self.leaving.discard(leaving)
            with trio.CancelScope(shield=True):
                await leaving.stack.aclose()
            logger.info("node {} closed", name)

    async def aclose(self) -> None:
        """Every node still open or leaving: connections closed, embedded servers stopped."""
        nodes = [*self.open.values(), *self.leaving]
        self.open.clear()
        self.leaving.clear()
        with trio.CancelScope(shield=True):
            async with AsyncExitStack() as every:  # each closed, whatever another raises
                for opened in nodes:
                    every.push_async_callback(opened.stack.aclose)


def _count_state_rpc(metrics: EdgeMetrics, node: str, rpc: str) -> None:
    metrics.node_state_rpcs.labels(node, rpc).inc()


def node_access(node: NodeConfig) -> NodeAccess:
    """The token and TLS of `node`'s connections, read from its files (checked when the
    configuration was read; one gone since is a ConfigError)."""
    token = None
    try:
        if node.token_file is not None:
            with open(node.token_file, "rb") as file:
                token = file.read().strip().decode()
        ssl = None
        if node.tls:
            ssl = client_ssl_context(node.ca_file, node.cert_file, node.key_file)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ConfigError(f"node {node.name}: {exc}") from None
    return NodeAccess(token=token or None, ssl=ssl, server_name=node.server_name)
