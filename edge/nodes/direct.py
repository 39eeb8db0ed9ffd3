"""The client of an `openai+http://` node: its runs go from the edge's own loop straight
to the model server, its state comes from the embedded iop-node.

An `openai+http://HOST:PORT/v1` node is iop-node run inside the edge
(`edge.nodes.embedded`). Its Describe and Watch are iop-node's, over gRPC
as for any node: the model list, the upstream's load read from its
`/metrics`, the continuation mode. Its runs skip it: each is the same relay
iop-node runs (`edge.nodes.upstream.relay`), here on trio in the run's read
task, its RunEvents turned into the edge's events as the gRPC client turns
them (`edge.node.convert.event_from_pb`). Measured on the fleet benchmark,
the gRPC hop (the edge's client, the bridge, iop-node's server and its
loop's thread) was most of the CPU an `openai+http://` run cost the edge.

What the gRPC client does for a run holds here too (`edge.node.client`): the
run's events are bounded in the same buffer, its deadline, its slow client
and the end of its request cancel its read task, once. Cancelling the read
leaves the relay's HTTP request, which closes the upstream connection: the
model server's abort, and the run's one cancel on the node (no CancelRun
follows: iop-node never saw the run).

A run is iop-node's in the node's reports: Describe and Watch count this
client's runs in flight as iop-node counts its own (its `active_runs`), so the
pool's load for the node is what it was with runs through iop-node.

A request keeps its RunRequest's message while an `openai+http://` node is
configured (`edge.node.wire.PreparedRunRequest.message`): the relay reads it,
not the bytes. Work that grows with a request (writing the upstream's body;
reading the bytes where there is no message: an answer continued from another
node, or a request parsed before the node was added) runs in a worker thread
past INLINE_BYTES, on the loop below: a small request would wait longer for a
thread than its work takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable, Mapping

import trio

from edge.contract._proto.iop.node import v1 as pb
from edge.errors import NodeFailedError
from edge.node.backlog import Backlog
from edge.node.bridge import EventBuffer, Item
from edge.node.client import GrpcNodeClient, NodeDescription, NodeSocket, RunHandle
from edge.node.convert import event_from_pb
from edge.node.grpc import Accepted
from edge.node.wire import EncodedRunRequest
from edge.nodes.kit import NodeSpans
from edge.nodes.upstream.relay import TERMINAL, Relay
from edge.nodes.upstream.server import UpstreamNode
from edge.observe.tracing import Tracing

# A RunRequest of up to this many bytes is read, and its upstream body written, on the
# loop (a few hundred microseconds at most); a larger one in a worker thread.
INLINE_BYTES = 32 * 1024


class DirectUpstreamClient(GrpcNodeClient):
    """A NodeClient whose runs `node`'s relay serves on trio; Describe and Watch are
    `node`'s, over gRPC on `where` (the Unix socket the embedded node listens on)."""

    def __init__(
        self,
        name: str,
        where: NodeSocket,
        *,
        node: UpstreamNode,
        tracing: Tracing | None = None,
        backlog: Backlog | None = None,
        on_state_rpc: Callable[[str], object] | None = None,
        on_cancel_sent: Callable[[], object] | None = None,
    ) -> None:
        """`on_cancel_sent` hears each run this client ended before its terminal (the
        upstream request closed: its cancel), as the gRPC client's hears each CancelRun."""
        super().__init__(name, where, backlog=backlog, on_state_rpc=on_state_rpc)
        self._on_cancelled = on_cancel_sent
        self._instance = node.instance_id
        self._spans = NodeSpans(tracing, name) if tracing is not None else None
        # `continuation_mode` and `is_llamacpp` read what iop-node's thread last read of
        # its upstream (its load, its model list, its probe's answer): each a value
        # replaced whole, never changed.
        self._relay = Relay(
            node.upstream, name=name, continuation_mode=node.continuation_mode,
            llamacpp=node.is_llamacpp, spans=self._spans,
        )  # fmt: skip
        self._running = 0

    async def read_events(
        self,
        handle: RunHandle,
        request: pb.RunRequest | EncodedRunRequest,
        events: EventBuffer,
        metadata: Mapping[str, str] | None,
    ) -> None:
        """The run relayed from here: sent and ACCEPTED at once (there is no node to
        accept it), then the upstream's events, up to the terminal."""
        self._running += 1
        try:
            run, deadline_unix_ms, body = await self._prepared(request)
            events.mark_sent()
            await _put(events, Accepted(self._instance))

            sent, outcome = 0, "aborted"  # no terminal: the edge ended the run

            async def emit(message: pb.RunEvent) -> None:
                nonlocal sent, outcome
                if message.type in TERMINAL:
                    outcome = message.type
                event = event_from_pb(message)
                if event is not None:
                    sent += 1
                    await _put(events, event)

            span = None
            if self._spans is not None:
                span = self._spans.run_span(metadata or {}, run.run_id, run.model, relayed=True)
            try:
                await self._relay.run(run, emit, span, body=body, deadline_unix_ms=deadline_unix_ms)
            finally:
                if span is not None:
                    NodeSpans.end_run(span, outcome, sent)
            if not events.terminal:
                raise NodeFailedError(f"node {self.name}: the run ended without a terminal event")
        finally:
            self._running -= 1

    async def _prepared(
        self, request: pb.RunRequest | EncodedRunRequest
    ) -> tuple[pb.RunRequest, int, bytes | ValueError]:
        """The RunRequest, the attempt's deadline and the upstream's body (or why there is
        none). The request's own message where it kept it (a config with this node keeps
        it: `PreparedRunRequest.message`), else its bytes parsed; both steps in one
        worker thread past INLINE_BYTES."""
        if isinstance(request, pb.RunRequest):
            return request, request.deadline_unix_ms, self._relay.body(request)
        encoded, relay = request, self._relay

        def prepare() -> tuple[pb.RunRequest, bytes | ValueError]:
            message = encoded.message
            if message is None:
                message = pb.RunRequest.parse(bytes(encoded))
            return message, relay.body(message)

        if len(request) <= INLINE_BYTES:
            message, body = prepare()
        else:
            message, body = await trio.to_thread.run_sync(prepare)
        return message, request.deadline_unix_ms, body

    async def cancel_on_node(self, handle: RunHandle) -> None:
        """Nothing to send: leaving the relay closed the upstream request."""
        if self._on_cancelled is not None:
            self._on_cancelled()

    async def describe(self) -> NodeDescription:
        return self._counted(await super().describe())

    async def watch(self, heartbeat_s: float) -> AsyncGenerator[NodeDescription, None]:
        async with contextlib.aclosing(super().watch(heartbeat_s)) as reports:
            async for report in reports:
                yield self._counted(report)

    def _counted(self, description: NodeDescription) -> NodeDescription:
        """`description` with this client's runs in flight as iop-node's own: at least
        that many run, less those its upstream says wait."""
        own = max(0, self._running - (description.waiting_runs or 0))
        if own <= description.active_runs:
            return description
        return dataclasses.replace(description, active_runs=own)

    async def aclose(self) -> None:
        try:
            with trio.CancelScope(shield=True):
                await self._relay.aclose()
        finally:
            await super().aclose()


async def _put(events: EventBuffer, item: Item) -> None:
    if not events.put_nowait(item):
        await events.wait_put(item)
