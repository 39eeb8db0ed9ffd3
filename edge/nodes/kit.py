"""What the node implementations in this repo share: the simulated node and iop-node.

- `NodeServer`: a grpclib server that listens on a socket it binds itself
  (so the port is known for port 0) and refuses a received message over
  gRPC's default 4 MiB, the edge's limit, with RESOURCE_EXHAUSTED
  (`NodeCodec`, on the contract's codec, which also sends messages
  serialized ahead of time as they are); `start_server` serves it behind a
  `NodeGuard` (`edge.nodes.guard`: bearer token, TLS) when given one.
- `NodeService`: the generated `NodeServiceBase` with CancelRun and the runs
  log; a node implements Describe (the generated signature) and `play`, one
  run's events: `serve_run` (Run, served at the stream level, see
  `NodeService.__mapping__`) owns the rest of a run, the same on every node
  (its record, span, acceptance, cancellation and outcome).
- The runs in flight and the runs log (`edge.nodes.runslog`: `RunRecord`,
  `RunsLog`).
- `NodeSpans`: with tracing on, one SERVER span per run, continued from the
  edge's `traceparent` (and iop-node's CLIENT span of its upstream request).
- Watch (`NodeService.watch`, served by `serve_watch`): the node's `describe`
  pushed to each watcher: one report at once, then one after each
  `state_changed` (changes closer than WATCH_MIN_INTERVAL_S are one report:
  coalesced, never queued), and at least one every heartbeat (the watcher's
  `heartbeat_ms`, clamped to WATCH_HEARTBEAT_MIN_MS..WATCH_HEARTBEAT_MAX_MS;
  WATCH_HEARTBEAT_MS when it asks for none). At most MAX_WATCHERS at once
  (one more: RESOURCE_EXHAUSTED); a report waits for a watcher that does not
  read (HTTP/2 flow control) at most WATCH_SEND_S, then that watcher is
  dropped (both are class attributes a node may set); a watcher that leaves
  is released with its stream, and one still there when the node stops is
  told so (UNAVAILABLE). A watcher costs one waiting task, woken by a change
  or its heartbeat: no polling.
  A node that keeps its KV cache by the edge's prefix blocks sets
  `NodeService.block_log` (`edge.nodes.blocklog`): each report then also
  carries the blocks stored and evicted since that watcher's previous report
  (each block once, as its last event left it, so applying the stored ones
  then the evicted ones, the contract's order, gives the node's set), or a
  snapshot of the whole set on its first report and after it fell behind the
  log. A watcher keeps only its position in the log. Other nodes leave the
  fields empty.

HTTP/2 MAX_CONCURRENT_STREAMS stays at the 100 grpclib's h2 connections
advertise: grpclib 0.4.9 has no public setting for it (its Configuration
covers windows and keep-alive only), so instead of reaching into its
protocol the edge opens one connection per `STREAMS_PER_CHANNEL` (90) runs.

Node side only (asyncio, grpclib); the edge imports it only to host the nodes it
runs inside itself (`edge/nodes/embedded.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import socket
from collections import deque
from collections.abc import AsyncGenerator, Collection, Mapping
from pathlib import Path
from ssl import SSLContext
from typing import Any, NoReturn
from urllib.parse import urlsplit

from grpclib.const import Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.codec import ContractCodec
from edge.contract.routes import INSTANCE_METADATA, MAX_MESSAGE_BYTES, RUN_ROUTE, WATCH_ROUTE
from edge.nodes.blocklog import BlockLog
from edge.nodes.guard import NodeGuard
from edge.nodes.runslog import Events, RunRecord, RunsLog
from edge.observe.tracing import OPERATION, PROVIDER, TRACEPARENT, Tracing, extract, set_error

# How long a node tries to tell a reading edge that CancelRun stopped its run.
CANCELLED_SEND_S = 1.0
# How long CancelRun waits for the run it stops to be over before answering.
CANCEL_STOP_S = 2.0
# How long stopping a node waits for its handlers, cancelled, to be over (each one's
# cleanup is bounded below this: CANCELLED_SEND_S, iop-node's CLOSE_TIMEOUT_S). From
# CPython 3.12.1 grpclib's wait_closed also waits for every client to close its connection
# (asyncio.Server.wait_closed, python/cpython#79033) and grpclib closes none
# (vmagamedov/grpclib#107; 0.4.9 is its newest release): with an edge connected, the wait
# would last as long as the edge.
STOP_WAIT_S = 3.0
BACKLOG = 2048
# Watch: changes closer than this are one report (a busy node sends each watcher at
# most 10 reports a second: about 1 ms of CPU each, node and edge together, measured on
# the simulated node); the heartbeat a watcher gets when it asks for none, and the range
# its own is clamped to (ms).
WATCH_MIN_INTERVAL_S = 0.1
WATCH_HEARTBEAT_MS = 2000
WATCH_HEARTBEAT_MIN_MS = 100
WATCH_HEARTBEAT_MAX_MS = 60_000
# Watchers of one node at once (edges x their worker processes); one more is refused.
MAX_WATCHERS = 256
# How long a report waits for its watcher to read before the watcher is dropped.
WATCH_SEND_S = 10.0

Reports = Stream[pb.WatchRequest, pb.DescribeResponse]


def watch_heartbeat_ms(asked: int) -> int:
    """The heartbeat a watcher that asked for `asked` ms gets (0: the node's default)."""
    if not asked:
        return WATCH_HEARTBEAT_MS
    return max(WATCH_HEARTBEAT_MIN_MS, min(asked, WATCH_HEARTBEAT_MAX_MS))


class NodeCodec(ContractCodec):
    """The contract's codec (`edge.contract.codec`) as a node serves: a received
    message over MAX_MESSAGE_BYTES ends the RPC with RESOURCE_EXHAUSTED, as
    gRPC's own limit answers."""

    def refuse(self, size: int) -> NoReturn:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"received message larger than max ({size} vs. {MAX_MESSAGE_BYTES})",
        )


class NodeServer(Server):
    """A grpclib server with the nodes' codec, listening on a socket of its own binding."""

    def __init__(self, handlers: Collection[NodeService]) -> None:
        super().__init__(handlers, codec=NodeCodec())

    async def listen(self, host: str, port: int, *, ssl: SSLContext | None = None) -> int:
        """Start serving on host:port (port 0: any free port); returns the bound port.

        The socket is bound here and handed to `Server.start(sock=...)`, so the
        port is read from our own socket. `ssl`: serve TLS with that context.
        """
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            await self.start(sock=sock, backlog=BACKLOG, ssl=ssl)
        except BaseException:
            sock.close()
            raise
        return int(sock.getsockname()[1])

    async def listen_unix(self, path: str) -> None:
        """Start serving on a Unix socket bound at `path`: whoever may open its directory
        reaches it, and no one else (a node served inside the edge)."""
        await self.start(path=path, backlog=BACKLOG)


async def start_server(
    node: NodeService, host: str, port: int, *, guard: NodeGuard | None = None
) -> tuple[NodeServer, int]:
    """Start serving `node`; returns the server and the port it listens on.

    `guard`: the token every RPC must carry and the TLS to serve (`edge.nodes.guard`).
    """
    server = NodeServer([node])
    if guard is not None:
        guard.attach(server)
    port = await server.listen(host, port, ssl=guard.ssl if guard is not None else None)
    return server, port


async def stop_server(node: NodeService, server: Server) -> None:
    """Stop accepting, cancel the handlers and wait for them (at most STOP_WAIT_S), then
    close the node (its runs log last). A connection its client keeps open stays open
    until the client closes it or the process ends."""
    server.close()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(STOP_WAIT_S):
            await server.wait_closed()
    await node.aclose()


async def wait_for_stop_signal() -> None:
    """Return on SIGTERM or SIGINT (a node run as its own process)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def send_cancelled(run: RunRecord) -> bool:
    """After CancelRun stopped `run`: tell an edge still reading, as the terminal event.

    Bounded in time (a reader whose window is closed does not hold the
    handler); False when the stream is gone (the edge reset it).
    """
    with contextlib.suppress(Exception):
        async with asyncio.timeout(CANCELLED_SEND_S):
            await run.send(pb.RunEvent(type="cancelled", error="run cancelled"))
            return True
    return False


class NodeSpans:
    """The node side: one SERVER span per Run, continued from the edge's traceparent.

    Named `chat {model}` with the GenAI attributes a node knows; the run's
    outcome and event count go on at its end. `client_span` is iop-node's
    request to its model server (a CLIENT span, whose context the server gets).
    """

    def __init__(self, tracing: Tracing, node: str) -> None:
        self.tracing = tracing
        self._tracer = tracing.tracer
        self._node = node

    def run_span(
        self, metadata: Mapping[str, Any], run_id: str, model: str, *, relayed: bool = False
    ) -> Span:
        """The span of one run. `relayed`: the edge relays the run itself (an
        `openai+http://` node, `edge.nodes.direct`): no Run call carried it, so the span
        is INTERNAL, without the `rpc.*` attributes."""
        parent = None
        value = metadata.get(TRACEPARENT)
        if isinstance(value, str):
            carrier = {TRACEPARENT: value}
            state = metadata.get("tracestate")
            if isinstance(state, str):
                carrier["tracestate"] = state
            parent = extract(carrier)
        attributes = {
            "gen_ai.operation.name": OPERATION,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": model,
            "iop.node": self._node,
            "iop.run_id": run_id,
        }
        if not relayed:
            attributes |= {
                "rpc.system": "grpc",
                "rpc.service": "iop.node.v1.NodeService",
                "rpc.method": "Run",
            }
        kind = SpanKind.INTERNAL if relayed else SpanKind.SERVER
        return self._tracer.start_span(
            f"{OPERATION} {model}", context=parent, kind=kind, attributes=attributes
        )

    def client_span(self, parent: Span, model: str, url: str) -> Span:
        """The span of one request to the model server, a child of the run's span."""
        parts = urlsplit(url)
        return self._tracer.start_span(
            f"{OPERATION} {model}",
            context=trace.set_span_in_context(parent),
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": OPERATION,
                "gen_ai.provider.name": "openai",
                "gen_ai.request.model": model,
                "http.request.method": "POST",
                "url.full": url,
                "server.address": parts.hostname or "",
                "server.port": parts.port or (443 if parts.scheme == "https" else 80),
            },
        )

    @staticmethod
    def end_run(span: Span, outcome: str | None, events_sent: int) -> None:
        span.set_attribute("iop.outcome", outcome or "unknown")
        span.set_attribute("iop.events_sent", events_sent)
        if outcome in ("error", "aborted"):
            set_error(span, "run_error" if outcome == "error" else "aborted")
        span.end()


class NodeService(pb.NodeServiceBase):  # type: ignore[misc]  # generated: not type-checked
    """A node's NodeService: subclasses implement `play` (and may `hold`) and `describe`.

    Run (`serve_run`) and CancelRun are common: a run is recorded in the runs
    log, and CancelRun stops a live run with its `stop` (its handler task's
    cancel, unless `play` sets another). So is Watch (`watch`, `serve_watch`),
    on what `describe` answers.
    """

    # Watchers at once, and how long a report waits for its watcher to read.
    max_watchers = MAX_WATCHERS
    watch_send_s = WATCH_SEND_S
    # The KV block events of a node that keeps its cache by the edge's prefix blocks,
    # for its watchers' reports (None: it does not; its reports carry no blocks).
    block_log: BlockLog | None = None

    def __init__(
        self, name: str, runs_log: Path | None = None, *, tracing: Tracing | None = None
    ) -> None:
        self.name = name
        # This life of the node (DescribeResponse.instance_id): new at each start.
        self.instance_id = secrets.token_hex(8)
        self.runs = RunsLog(runs_log)
        # One span per run, continued from the edge's traceparent (None: tracing off).
        self.spans = NodeSpans(tracing, name) if tracing is not None else None
        # One event per watcher, set by `state_changed`.
        self._watchers: set[asyncio.Event] = set()

    def run_span(self, stream: Events, run: RunRecord) -> Span | None:
        """The span of `run` (None: tracing is off), a child of the edge's span when the
        Run call's metadata carries its `traceparent`."""
        if self.spans is None:
            return None
        return self.spans.run_span(stream.metadata or {}, run.run_id, run.model)

    @staticmethod
    def end_span(span: Span | None, run: RunRecord) -> None:
        if span is not None:
            NodeSpans.end_run(span, run.outcome, run.events_sent)

    def __mapping__(self) -> dict[str, Handler]:
        """The generated mapping, with Run and Watch served at the stream level.

        The generated Run handler sends the response headers with the first
        event; a node accepts a run (the headers) before its first event,
        which may be a long way off, so Run gets the stream itself. Watch
        gets it to bound each send and to close its reports however the
        stream ends (`serve_watch`).
        """
        mapping: dict[str, Handler] = super().__mapping__()
        for route, serve in ((RUN_ROUTE, self.serve_run), (WATCH_ROUTE, self.serve_watch)):
            generated = mapping[route]
            mapping[route] = Handler(
                serve, generated.cardinality, generated.request_type, generated.reply_type
            )
        return mapping

    @property
    def active_runs(self) -> int:
        return self.runs.active

    def state_changed(self) -> None:
        """The node's state (what `describe` answers) changed: Watch reports it.

        The kit calls it when a run starts or ends; a node calls it when its
        load changes otherwise (its model server's queue, its KV cache).
        Cheap: it wakes each watcher (at most MAX_WATCHERS), which reports
        once however many changes came since its last report."""
        for changed in self._watchers:
            changed.set()

    async def watch(self, message: pb.WatchRequest) -> AsyncGenerator[pb.DescribeResponse, None]:
        """The reports of one watcher: `describe` with `heartbeat_ms` and `seq`.

        One at once, then one after each change (`state_changed`; changes
        within WATCH_MIN_INTERVAL_S of the last report wait for its end, and
        are one report), and one every heartbeat without a change. A report
        is made when the caller takes it: a watcher that reads slowly gets
        the state of when it reads, never a queue of old ones. With a
        `block_log`, each report carries the KV blocks stored and evicted
        since this watcher's previous one (a snapshot on its first).
        """
        if len(self._watchers) >= self.max_watchers:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED, f"this node has {self.max_watchers} watchers already"
            )
        heartbeat_ms = watch_heartbeat_ms(message.heartbeat_ms)
        changed = asyncio.Event()
        self._watchers.add(changed)
        loop = asyncio.get_running_loop()
        try:
            seq = 0
            position: int | None = None  # in `block_log`: None until the first report
            while True:
                changed.clear()  # a change from here on is in the next report
                report = await self.describe(pb.DescribeRequest())
                if self.block_log is not None:
                    position = self.block_log.report(report, position)
                seq += 1
                report.heartbeat_ms = heartbeat_ms
                report.seq = seq
                yield report
                sent_at = loop.time()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(heartbeat_ms / 1000):
                        await changed.wait()
                await asyncio.sleep(max(0.0, sent_at + WATCH_MIN_INTERVAL_S - loop.time()))
        finally:
            self._watchers.discard(changed)

    async def serve_watch(self, stream: Reports) -> None:
        """One Watch: `watch`'s reports sent, each waiting at most `watch_send_s` for the
        watcher to read; the reports are closed (the watcher released) however the
        stream ends: the watcher leaving, the node stopping, a send that waited too long.

        Stopped (the server closing), it tells a watcher still there at once, with
        UNAVAILABLE (bounded, as `send_cancelled`), rather than leave it waiting for
        its silence bound on a connection that outlives the handler.
        """
        request = await stream.recv_message()
        assert request is not None
        limit_s = self.watch_send_s
        try:
            async with contextlib.aclosing(self.watch(request)) as reports:
                async for report in reports:
                    try:
                        async with asyncio.timeout(limit_s):
                            await stream.send_message(report)
                    except TimeoutError:
                        raise GRPCError(
                            Status.UNAVAILABLE, f"the watcher read no report for {limit_s:g}s"
                        ) from None
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CANCELLED_SEND_S):
                    await stream.send_trailing_metadata(
                        status=Status.UNAVAILABLE, status_message="the node is stopping"
                    )
            raise

    @property
    def watchers(self) -> int:
        """Watch streams open on this node now."""
        return len(self._watchers)

    @property
    def finished(self) -> deque[dict[str, Any]]:
        """The last FINISHED_KEPT runs-log records written (for in-process users)."""
        return self.runs.finished

    async def serve_run(self, stream: Events) -> None:
        """One Run: what every node does around its `play`, in one order.

        The run is recorded (the runs log, CancelRun's target, Describe's
        active_runs) and its span opened, then it is accepted (after `hold`:
        the response headers), then played. Record, then accept: an edge may
        send CancelRun as soon as it has sent Run, and one that arrives while
        the run is held or being accepted finds it and stops it, rather than
        being logged as a run the node does not know while the run plays on.

        A CancelledError (CancelRun, a reset stream, the server stopping) ends
        a run that has no outcome yet "cancelled"; when CancelRun stopped it,
        an edge still reading is told (`send_cancelled`). A run that ends any
        other way without an outcome is an "error". Then its runs-log line is
        written (or waits for a late CancelRun) and its span ends.
        """
        request = await stream.recv_message()
        assert request is not None
        run = self.runs.start(request.run_id, request.model, stream)
        run.task = asyncio.current_task()
        run.stop = run.task.cancel if run.task is not None else None
        self.state_changed()
        span = self.run_span(stream, run)
        try:
            await self.hold(request)
            await stream.send_initial_metadata(metadata={INSTANCE_METADATA: self.instance_id})
            outcome = await self.play(run, request, span)
            if run.outcome is None:
                run.outcome = outcome
                if outcome == "cancelled" and run.cancel_rpcs:
                    await send_cancelled(run)  # CancelRun stopped it: a caller reading is told
        except asyncio.CancelledError:
            if run.outcome is None:
                run.outcome = "cancelled"
                if run.cancel_rpcs and await send_cancelled(run):
                    return  # CancelRun stopped it while the caller still reads: it was told
            raise
        finally:
            if run.outcome is None:
                run.outcome = "error"
            self.runs.ended(run)
            self.state_changed()
            self.end_span(span, run)

    async def hold(self, request: pb.RunRequest) -> None:
        """What the node waits for before it accepts `request` (nothing, unless it says)."""

    async def play(self, run: RunRecord, request: pb.RunRequest, span: Span | None) -> str:
        """Play an accepted run: send its events (`run.send`); returns its outcome.

        A run stopped by CancelRun raises CancelledError, or returns "cancelled"
        (`serve_run` records either, and tells a caller still reading). A node may
        set `run.outcome` itself (a terminal event it sent, or before raising):
        that one is kept.
        """
        raise GRPCError(Status.UNIMPLEMENTED)

    async def aclose(self) -> None:
        """Release what the node holds; the runs log's pending lines are written."""
        self.runs.close()

    async def cancel_run(self, message: pb.CancelRunRequest) -> pb.CancelRunResponse:
        """Stop the run, and answer once it is over here (bounded): an edge that heard
        the answer may start the run on another node, never beside this one."""
        run, found = self.runs.cancel_rpc(message.run_id)
        if run is not None and run.task is not None and run.stop is not None:
            task = run.task
            run.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait([task], timeout=CANCEL_STOP_S)
        return pb.CancelRunResponse(found=found)
