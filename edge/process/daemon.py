"""The daemon: the root nursery that holds the server and the nodes.

`serve(config)` opens the asyncio loop the node bridge needs, starts any
embedded simulated node, learns the nodes' models, and serves HTTP (the
edge's own loop around hypercorn's protocol classes, `edge.http.server`)
until `shutdown` is set. There is no edge-wide nursery of runs: each run
lives in its request's scope (`edge.http.scope`) and ends with it.

Shutdown drains: stop accepting, answer new requests 503, let streams in
flight finish within `drain_timeout_s`, then end what is left through the
one cancel path (each stream gets a notice frame, each run a CancelRun),
and let the server close the connections. Then the spans still queued for
export are flushed (tracing on: `edge.observe.tracing`), off the loop.

A worker process (`edge.process.supervisor`) runs the same `serve`, on listening
sockets its supervisor bound (`listen_sockets`), and its sd_notify lines go
to the supervisor (`edge.process.systemd.attach_supervisor`).

Requests run on a snapshot of the configuration (`edge.http.live`): built here at
start, and again by each reload (`edge.process.reload`; SIGHUP, when `serve` is
given a way to read the file again) while the edge serves.
"""

from __future__ import annotations

import gc
import logging
import shutil
import socket
import sqlite3
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig
from loguru import logger

from edge.config import Config, NodeConfig, split_address
from edge.fleet.admission import Admission
from edge.fleet.failover import Failover
from edge.fleet.fleet import Fleet
from edge.fleet.pool import NodePool
from edge.fleet.run import OutcomeHook
from edge.fleet.runs import Runs
from edge.fleet.turns import Turns
from edge.http.app import EdgeApp, create_app
from edge.http.chat import ChatService
from edge.http.connection import ServerLimits
from edge.http.live import Snapshots
from edge.http.refusals import shed_at_once
from edge.http.server import ACCEPT_BURST, HttpServer
from edge.http.stored import ResponseStates
from edge.node.backlog import BEYOND_BUFFER, Backlog
from edge.node.bridge import asyncio_loop
from edge.observe.log import count_dropped_lines
from edge.observe.logbound import clip
from edge.observe.metrics import EdgeMetrics
from edge.observe.tracing import Tracing, setup_tracing
from edge.process import supervisor, systemd
from edge.process.discovery import Discovery
from edge.process.listeners import (
    LISTEN_BACKLOG,
    default_max_connections,
    listen_mode,
    raise_fd_limit,
)
from edge.process.nodeset import NodeSet
from edge.process.reload import LimiterKeeper, Loader, Reloader, Reloads, build_snapshot
from edge.process.signals import Reload
from edge.store.stores import open_response_store

# After the drain deadline: time for the notice frames to go out before
# the HTTP server cuts the connections that are left.
_CLOSE_GRACE_S = 2.0


@dataclass
class Edge:
    """A running edge, as `serve` reports it through `task_status`."""

    url: str
    pool: NodePool
    chat: ChatService
    # The runs in flight, and the queue for node slots (with the memory budget).
    runs: Runs
    admission: Admission
    metrics: EdgeMetrics
    shutdown: trio.Event
    embedded: list[object] = field(default_factory=list)
    # The configuration requests run on (a reload swaps it).
    snapshots: Snapshots | None = None


def _hypercorn_config(config: Config) -> HypercornConfig:
    """Settings of hypercorn's protocol classes, as `edge.http.server` runs them."""
    hc = HypercornConfig()
    hc.backlog = LISTEN_BACKLOG
    hc.graceful_timeout = config.server.drain_timeout_s + _CLOSE_GRACE_S
    hc.accesslog = None
    # Hand hypercorn a stdlib logger (routed into loguru), or it writes to stderr itself.
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


def _server_limits(config: Config) -> ServerLimits:
    """The connection limits; the fd limit is raised to its hard limit first."""
    fd_limit = raise_fd_limit()
    derived = default_max_connections(fd_limit)
    max_connections = config.server.max_connections or derived
    if max_connections > derived:
        logger.warning(
            "server.max_connections = {} leaves too few of the {} file descriptors for the"
            " rest: at the limit, accepts fail until a connection ends",
            max_connections, fd_limit,
        )  # fmt: skip
    return ServerLimits(
        max_connections,
        config.timeouts.slow_client_s,
        idle_timeout_s=config.server.idle_timeout_s,
        body_timeout_s=config.server.body_timeout_s,
    )


async def serve(
    config: Config,
    *,
    runs_log: Path | None = None,
    on_outcome: OutcomeHook | None = None,
    shutdown: trio.Event | None = None,
    listen_sockets: Sequence[socket.socket] = (),
    shared_dir: Path | None = None,
    metrics_dir: Path | None = None,
    digest: str = "",
    load: Loader | None = None,
    reloads: Reloads | None = None,
    task_status: trio.TaskStatus[Edge] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the edge until its `shutdown` event is set, then drain and return.

    `listen_sockets`: serve these (bound and listening already) instead of binding
    `server.listen`. A worker's `shared_dir` and `metrics_dir` are its supervisor's
    (`edge.process.supervisor`): the limits and the metrics of every worker of the edge.
    `digest` is the configuration file's (`iop_edge_config_info`); with `load` (how to
    read it again) each reload asked of `reloads` is applied while the edge serves.
    """
    if shutdown is None:
        shutdown = trio.Event()
    metrics = EdgeMetrics(metrics_dir)
    count_dropped_lines(metrics.log_lines_dropped.inc)
    metrics.gc_pauses.start()
    tracing = setup_tracing(config.tracing, service="iop-edge")
    metrics.tracing.set(0 if tracing is None else 1)
    try:
        await _serve(config, metrics, tracing, shutdown, runs_log, on_outcome, listen_sockets,
                     shared_dir, digest, load, reloads, task_status)  # fmt: skip
    finally:
        metrics.gc_pauses.stop()
        if tracing is not None:  # the spans still queued go out (bounded by the exporter)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(tracing.shutdown)
    logger.info("iop-edge stopped")


async def _serve(
    config: Config,
    metrics: EdgeMetrics,
    tracing: Tracing | None,
    shutdown: trio.Event,
    runs_log: Path | None,
    on_outcome: OutcomeHook | None,
    listen_sockets: Sequence[socket.socket],
    shared_dir: Path | None,
    digest: str,
    load: Loader | None,
    reloads: Reloads | None,
    task_status: trio.TaskStatus[Edge],
) -> None:
    """The root nursery: nodes, pool, background tasks, server, readiness, drain."""
    async with asyncio_loop(), AsyncExitStack() as stack:
        discovery = await _discover(config, metrics)
        nodes = await _open_nodes(
            stack, config, discovery.nodes(config.nodes), metrics, tracing, runs_log, shared_dir
        )
        pool = await _open_pool(config, nodes, metrics)
        fleet = _fleet(config, pool, metrics)
        # The limiter is closed by `stack`, inside the asyncio loop its Redis client may use.
        limits = LimiterKeeper(config.limits, metrics, shared_dir, stack)
        snapshots = Snapshots(build_snapshot(config, digest, fleet.runs, limits))
        metrics.config_loaded(digest, snapshots.current.loaded_at)
        async with trio.open_nursery() as root:
            _start_background(root, config, fleet, metrics)
            root.start_soon(discovery.run, snapshots, nodes, pool, fleet.runs, root)
            if load is not None and reloads is not None:
                reloader = Reloader(
                    config, load, snapshots, nodes, pool, fleet.admission, fleet.runs, limits,
                    metrics, discovery, tracing, shared_dir,
                )  # fmt: skip
                root.start_soon(reloader.run, reloads, root)
            responses = await _open_responses(stack, config, metrics, shared_dir)
            chat = ChatService(
                snapshots, fleet, metrics, on_outcome, tracing=tracing, responses=responses
            )
            edge_app = create_app(
                chat, snapshots=snapshots, max_body_bytes=config.server.max_body_bytes
            )
            server = _http_server(config, edge_app, fleet, metrics, listen_sockets)
            http_done = trio.Event()
            binds = await root.start(
                _serve_http, server, config, shutdown, http_done, listen_sockets
            )
            url = binds[0]
            logger.info("iop-edge serving on {} ({} node(s))", url, len(pool.nodes))
            systemd.notify("READY=1\nSTATUS=serving")
            edge = Edge(url, pool, chat, fleet.runs, fleet.admission, metrics, shutdown,
                        nodes.embedded, snapshots)  # fmt: skip
            task_status.started(edge)
            await shutdown.wait()
            await _drain(config, edge_app.start_draining, chat, http_done)
            root.cancel_scope.cancel()


async def _discover(config: Config, metrics: EdgeMetrics) -> Discovery:
    """The nodes found by DNS: each discover entry looked up once before the nodes open."""
    errors = metrics.discovery_errors

    def count(entry: str, reason: str) -> None:
        errors.labels(entry, reason).inc()

    discovery = await Discovery.open(config.discovery, count)
    await discovery.resolve(config.nodes)
    return discovery


async def _open_nodes(
    stack: AsyncExitStack,
    config: Config,
    wanted: Sequence[NodeConfig],
    metrics: EdgeMetrics,
    tracing: Tracing | None,
    runs_log: Path | None,
    shared_dir: Path | None,
) -> NodeSet:
    """The clients of the nodes `wanted` (the configured ones, and those found by DNS),
    and the nodes served in this process (embedded simulated nodes, iop-node in front of a
    model server: each on a Unix socket in a directory of its own, in `shared_dir` for a
    worker), closed by `stack`."""
    # What the runs' buffers of all the nodes hold for their streams, bounded in sum.
    backlog = Backlog(
        config.timeouts.slow_client_backlog_chars,
        per_waiter=BEYOND_BUFFER,
        on_cut=metrics.backlog_cuts.inc,
    )
    metrics.watch_backlog(lambda: backlog.chars)
    nodes = NodeSet(metrics, backlog, tracing, runs_log, run_dir=shared_dir)
    stack.push_async_callback(nodes.aclose)
    await nodes.open_all(wanted)
    return nodes


async def _open_pool(config: Config, nodes: NodeSet, metrics: EdgeMetrics) -> NodePool:
    """The pool of `nodes`, after a first look at every node."""
    opened = list(nodes.open.values())
    caps = {n.config.name: n.config.max_runs for n in opened if n.config.max_runs is not None}
    pool = NodePool(
        [n.client for n in opened], routing=config.routing,
        refresh_s=config.server.node_refresh_s, max_runs=caps,
    )  # fmt: skip
    for node, state in zip(opened, pool.nodes, strict=True):
        nodes.watch(pool, node, state)
    pool.picker.on_routed = metrics.cache_routed
    await pool.feed.refresh()
    for state in pool.nodes:
        if not state.healthy:
            logger.warning(
                "node {} ({}) is not reachable yet: {}",
                state.client.name, state.client.address, clip(state.error or ""),
            )  # fmt: skip
    return pool


def _fleet(config: Config, pool: NodePool, metrics: EdgeMetrics) -> Fleet:
    """The scheduler's turns, the admission queue, the runs and failover on `pool`, as
    the config sets them."""
    turns = Turns(on_defer=metrics.deferred_steps.inc)
    admission = Admission(pool, config.admission, metrics)
    runs = Runs(pool, config.timeouts, metrics, admission, turns)
    return Fleet(pool, turns, admission, runs, Failover(runs, config.routing))


def _start_background(
    root: trio.Nursery, config: Config, fleet: Fleet, metrics: EdgeMetrics
) -> None:
    """The tasks that run as long as the edge: node refresh, the scheduler's turns,
    systemd's watchdog, and (a worker) the metrics other workers' scrapes read."""
    root.start_soon(fleet.pool.feed.run_refresh)
    interval = systemd.watchdog_interval()
    if interval is not None:
        root.start_soon(systemd.watchdog_loop, interval)
    if metrics.multiproc_dir is not None:
        root.start_soon(_sync_metrics, metrics, config.server.node_refresh_s)
    root.start_soon(fleet.turns.run)


async def _open_responses(
    stack: AsyncExitStack, config: Config, metrics: EdgeMetrics, shared_dir: Path | None
) -> ResponseStates | None:
    """The response store (None: `[responses] store = "off"`), closed by `stack`. Its
    SQLite file, unless `path` is set, is in systemd's state directory, else in the edge
    run's directory (a worker's: its supervisor's; a single process: its own, removed
    when it stops)."""
    directory = systemd.state_directory() or shared_dir
    wanted = config.responses.store == "sqlite" and config.responses.path is None
    if directory is None and wanted:
        directory = Path(tempfile.mkdtemp(prefix="iop-edge-"))
        stack.callback(shutil.rmtree, directory, ignore_errors=True)
    try:
        store = await open_response_store(config, directory or Path("."))
    except (OSError, sqlite3.Error) as exc:  # the edge does not start: one clear line
        logger.error(
            'responses store: cannot open it: {} (set [responses] path, or store = "off")', exc
        )
        raise SystemExit(1) from None
    if store is None:
        return None
    stack.push_async_callback(store.aclose)
    return ResponseStates(store, metrics)


def _http_server(
    config: Config,
    edge_app: EdgeApp,
    fleet: Fleet,
    metrics: EdgeMetrics,
    listen_sockets: Sequence[socket.socket],
) -> HttpServer:
    """The HTTP server of `edge_app`, shedding at once what the admission would."""
    # Workers accepting from one shared socket take one connection per wakeup
    # each (as nginx's multi_accept off), so that none takes the others' share.
    shared = bool(listen_sockets) and listen_mode() == "shared"
    return HttpServer(
        edge_app.app, _hypercorn_config(config), _server_limits(config), metrics,
        turn=fleet.turns.turn, shed=partial(shed_at_once, fleet.admission),
        accept_burst=1 if shared else ACCEPT_BURST,
    )  # fmt: skip


async def _drain(
    config: Config, start_draining: Callable[[], None], chat: ChatService, http_done: trio.Event
) -> None:
    systemd.notify("STOPPING=1\nSTATUS=draining")
    start_draining()
    logger.info(
        "draining: {} stream(s) in flight, up to {}s",
        len(chat.runs.live), config.server.drain_timeout_s,
    )  # fmt: skip
    with trio.move_on_after(config.server.drain_timeout_s):
        await chat.runs.wait_idle()
    left = chat.shutdown_streams()
    if left:
        logger.warning("drain deadline passed: cancelled {} stream(s)", left)
    with trio.move_on_after(_CLOSE_GRACE_S + 1.0):
        await http_done.wait()


async def _serve_http(
    server: HttpServer,
    config: Config,
    shutdown: trio.Event,
    done: trio.Event,
    sockets: Sequence[socket.socket],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    host, port = split_address(config.server.listen)
    try:
        await server.serve(host, port, shutdown, sockets=sockets, task_status=task_status)
    finally:
        done.set()


async def _sync_metrics(metrics: EdgeMetrics, every_s: float) -> None:
    """Worker processes: the values other workers' scrapes read, kept current."""
    while True:
        metrics.sync()
        await trio.sleep(every_s)


def run_forever(
    config: Config,
    signals: Callable[[trio.Event, Reload], Awaitable[None]],
    *,
    runs_log: Path | None = None,
    listen_sockets: Sequence[socket.socket] = (),
    digest: str = "",
    load: Loader | None = None,
) -> None:
    """Serve until `signals` sets the shutdown event; returns once drained. The reloads
    `signals` asks for read the configuration again with `load`."""

    # The objects made at startup live as long as the process: keep them out of
    # the collector's way. A collection's pause grows with what it scans: young
    # collections are kept small and frequent (2,000: pauses of 1-5 ms, where
    # 50,000 paused 30-50 ms), and the middle generation is collected every 5 of
    # them, before it grows (pauses of 5-11 ms). A full collection scans every
    # open stream's objects: 50-250 ms with 1,000 streams open, a stall of every
    # stream at once (iop_edge_gc_pause_seconds{generation="2"}); one every 100
    # middle ones, not 20, keeps it out of a paced stream's p99 (BENCHMARKS.md).
    # Requests leave no reference cycles of their own
    # (tests/integration/test_garbage_e2e.py), so what waits longer for a full
    # collection is mostly libraries' (werkzeug's router, trio's).
    gc.collect()
    gc.freeze()
    gc.set_threshold(2_000, 5, 100)

    async def main() -> None:
        shutdown = trio.Event()
        reloads = Reloads()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(signals, shutdown, reloads.ask)
            await serve(
                config, shutdown=shutdown, runs_log=runs_log, listen_sockets=listen_sockets,
                shared_dir=supervisor.shared_dir(), metrics_dir=supervisor.metrics_dir(),
                digest=digest, load=load, reloads=reloads,
            )  # fmt: skip
            nursery.cancel_scope.cancel()

    trio.run(main)
