"""The asyncio side of talking to a node: grpclib channels (to a TCP address, or to the
Unix socket of a node served in this process: `NodeSocket`), the run read loop, and
Watch subscriptions (`NodeWatch`).

Everything here runs on the asyncio loop that `edge.node.bridge` hosts inside
trio. It knows nothing of trio: events leave through an `EventSink`, and every
grpclib/OS error is translated here, once, into the edge's error tree.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar, cast

from grpclib.client import Channel, Stream
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.events import SendRequest, listen
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.codec import ContractCodec
from edge.contract.routes import INSTANCE_METADATA, MAX_MESSAGE_BYTES, RUN_ROUTE, WATCH_ROUTE
from edge.errors import (
    EdgeError,
    NodeError,
    NodeFailedError,
    NodeTimeoutError,
    NodeUnavailableError,
)
from edge.node.access import NodeAccess
from edge.node.convert import Refused, RunEventDecoder, Skip
from edge.node.describe import MAX_NAME_CHARS
from edge.node.wire import EncodedRunRequest
from edge.stream.events import Complete, Failed, NodeEvent

# grpclib servers advertise MAX_CONCURRENT_STREAMS=100 and the client silently
# queues stream 101 and up: open another connection before that.
STREAMS_PER_CHANNEL = 90
IDLE_CHANNELS = 4
# The connection window is large, so a stalled run (its stream window full)
# never freezes the runs beside it on the same connection. The stream window
# is 128 KiB, not gRPC's 64 KiB: a stream is paced by window / round trip, and
# on a loaded edge a round trip (read, ack) takes tens of milliseconds (128 KiB
# at 50 ms: 2.5 MB/s, far above any model's rate). It is also what a stream
# whose client stopped reading holds undecoded: 256 KiB cost the hostile mix's
# stalled readers ~20 MiB more.
STREAM_WINDOW = 128 * 1024
_H2_CONFIG = Configuration(
    http2_connection_window_size=64 * 1024 * 1024,
    http2_stream_window_size=STREAM_WINDOW,
)
T = TypeVar("T")
# A run given up because its client left reads on for this many passes of the
# asyncio loop, at most SETTLE_S, before its stream is reset (`GrpcNode.read_run`).
# A pass runs every callback queued before it: the first hands over what grpclib
# already holds, the next ones what the socket held, once the loop reads it. On
# an idle edge four passes take microseconds; a loaded one runs one callback per
# trio scheduler pass (trio-asyncio), behind every stream's, so a pass takes as
# long as the backlog of the loop.
SETTLE_PASSES = 4
SETTLE_S = 0.25
_CONNECT_ERRORS = (OSError, asyncio.TimeoutError, ConnectionError)


class BoundedCodec(ContractCodec):
    """The contract's codec (`edge.contract.codec`: a received message over
    MAX_MESSAGE_BYTES is dropped before it is parsed) as the edge reads a node.

    The run fails with a clear error and the connection's other runs go on.
    The bytes of that one message were still received (the node's HTTP/2
    window is granted again as grpclib reads); the limit bounds what is
    parsed and kept.

    The message is answered with `Refused` (its size only), not an exception:
    raised here, the error's traceback would hold the frames that hold the
    message, kept as long as the error is (see `Refused`). The caller raises.
    """

    def refuse(self, size: int) -> Refused:
        return Refused(
            f"the node sent a message of {size} bytes, over the"
            f" {MAX_MESSAGE_BYTES}-byte gRPC message limit"
        )


_CODEC = BoundedCodec()
_OPEN = NodeAccess()


@dataclass(frozen=True, slots=True)
class NodeSocket:
    """Where a node's connections go: TCP `host:port`, or the Unix socket at `path` (a
    node served in this process). `address` is what errors, logs and /readyz call it."""

    address: str
    host: str | None = None
    port: int | None = None
    path: str | None = None

    @classmethod
    def tcp(cls, host: str, port: int) -> NodeSocket:
        return cls(f"{host}:{port}", host=host, port=port)

    @classmethod
    def unix(cls, path: str, address: str) -> NodeSocket:
        return cls(address, path=path)


def open_channel(where: NodeSocket, access: NodeAccess = _OPEN) -> Channel:
    """A connection to the node at `where` (opened on its first call), with `access`'s
    TLS, and its token on every call."""
    config = _H2_CONFIG
    if access.server_name is not None:
        config = replace(config, ssl_target_name_override=access.server_name)
    channel = Channel(
        where.host, where.port, path=where.path, codec=_CODEC, config=config, ssl=access.ssl
    )
    if access.token is not None:
        listen(channel, SendRequest, access.authorize)
    return channel


class Accepted:
    """The first item a run puts into its sink: the node has accepted the run, in
    the life of its process `instance` names ("": the node does not say)."""

    __slots__ = ("instance",)

    def __init__(self, instance: str = "") -> None:
        self.instance = instance


ACCEPTED = Accepted()


def _accepted(metadata: Mapping[str, str | bytes] | None) -> Accepted:
    """The accept of a run, with the node's instance from its initial metadata (one
    longer than a name may be, as Describe bounds it, is not taken: no instance)."""
    value = metadata.get(INSTANCE_METADATA) if metadata is not None else None
    if isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS:
        return Accepted(value)
    return ACCEPTED


class EventSink(Protocol):
    """Where a run's events go; `put_nowait` says False when the sink is full.

    `mark_sent`: the run's RunRequest is written to the node's connection. The node's
    time to accept the run counts from then, not from when the edge began (a
    connection to make, or this loop behind under load). A mark, not an item: the
    run's starter, waiting for ACCEPTED, is not woken for it."""

    def put_nowait(self, item: NodeEvent | Accepted) -> bool: ...

    def put(self, item: NodeEvent | Accepted) -> Awaitable[None]: ...

    def mark_sent(self) -> None: ...


def _describe_status(err: GRPCError) -> str:
    return f"{err.status.name}: {err.message}" if err.message else err.status.name


def translate_error(
    exc: BaseException, *, accepted: bool, address: str, sent: bool = True
) -> EdgeError:
    """A grpclib or OS error as the edge's error: the one translation point. `sent`:
    whether the run's RunRequest was written first (`NodeError.sent`)."""
    error = _translated(exc, accepted=accepted, address=address)
    error.sent = sent
    return error


def _translated(exc: BaseException, *, accepted: bool, address: str) -> NodeError:
    if isinstance(exc, GRPCError):
        if exc.status is Status.DEADLINE_EXCEEDED:
            return NodeTimeoutError(f"node {address} timed out")
        if exc.status is Status.UNAVAILABLE and not accepted:
            return NodeUnavailableError(f"node {address} is unavailable: {_describe_status(exc)}")
        return NodeFailedError(f"node {address} failed the run: {_describe_status(exc)}")
    if not accepted and isinstance(exc, _CONNECT_ERRORS):
        return NodeUnavailableError(f"node {address} is unreachable: {exc or type(exc).__name__}")
    if isinstance(exc, AttributeError):
        # grpclib opening a stream on a connection that closed under it ("'Connection'
        # object has no attribute '_transport'", vmagamedov/grpclib#110): the node's
        # connection failed before the run was sent, not the edge.
        return NodeUnavailableError(f"node {address} closed the connection: {exc}")
    return NodeFailedError(f"node {address} stream broke: {exc or type(exc).__name__}")


async def settle_read(
    reading: asyncio.Task[None], passes: int = 0, *, settles: Callable[[], bool] | None = None
) -> None:
    """Let `reading` go on for `passes` passes of the loop (SETTLE_PASSES when
    `settles()` says so), at most SETTLE_S, then cancel it if it is not over; returns
    once it is (its stream closed or reset)."""
    if settles is not None and settles():
        passes = SETTLE_PASSES
    loop = asyncio.get_running_loop()
    until = loop.time() + SETTLE_S
    for _ in range(passes):
        if reading.done() or loop.time() >= until:
            break
        await asyncio.sleep(0)  # behind every callback queued so far
    reading.cancel()
    await asyncio.wait((reading,))
    if not reading.cancelled():
        reading.exception()  # retrieved: the run was given up, its error says nothing more


class WatchUnsupported(Exception):
    """The node refused Watch before any report: it is older than that RPC, or has all
    the watchers it takes (ask it with Describe instead)."""


# What a node answers Watch with, before any report, when it will not be watched:
# UNIMPLEMENTED (an older node; grpclib's server sends it without a content-type,
# which grpclib's client reads as UNKNOWN, as it reads a handler's own failure), and
# RESOURCE_EXHAUSTED (its watchers' cap).
_NO_WATCH = frozenset({Status.UNIMPLEMENTED, Status.UNKNOWN, Status.RESOURCE_EXHAUSTED})


class NodeWatch:
    """One Watch subscription, on a connection of its own.

    `open` sends the request, `next` waits for the next report, `aclose`
    closes the connection: whatever state the stream is in (a report half
    received, a node that stopped answering), nothing of it is left at either
    end, and the node's handler sees its watcher leave. A subscription is
    opened again (after a broken stream, a silence) on a new connection.
    """

    def __init__(self, where: NodeSocket, access: NodeAccess = _OPEN) -> None:
        self.where = where
        self.address = where.address
        self.access = access
        self._channel: Channel | None = None
        self._stack = AsyncExitStack()
        self._stream: Stream[pb.WatchRequest, pb.DescribeResponse | Refused] | None = None
        self._reports = 0

    def _error(self, exc: BaseException) -> Exception:
        if isinstance(exc, GRPCError) and exc.status in _NO_WATCH and not self._reports:
            return WatchUnsupported(
                f"node {self.address} takes no watcher: {_describe_status(exc)}"
            )
        return translate_error(exc, accepted=False, address=self.address)

    async def open(self, heartbeat_ms: int) -> None:
        """Subscribe, asking for a report at least every `heartbeat_ms`."""
        self._channel = open_channel(self.where, self.access)
        stream = self._channel.request(
            WATCH_ROUTE, Cardinality.UNARY_STREAM, pb.WatchRequest, pb.DescribeResponse
        )
        try:
            await self._stack.enter_async_context(stream)
            await stream.send_message(pb.WatchRequest(heartbeat_ms=heartbeat_ms), end=True)
        except (GRPCError, StreamTerminatedError, ProtocolError, *_CONNECT_ERRORS) as exc:
            raise self._error(exc) from exc
        self._stream = stream

    async def next(self) -> pb.DescribeResponse:
        """The next report. Raises WatchUnsupported, or an EdgeError when the stream
        broke, ended, or carried a message past the limit or not a report."""
        assert self._stream is not None, "open the subscription first"
        try:
            report = await self._stream.recv_message()
        except (GRPCError, StreamTerminatedError, ProtocolError, *_CONNECT_ERRORS) as exc:
            raise self._error(exc) from exc
        except Exception as exc:  # a malformed report (protobuf decode), or any other surprise
            raise NodeFailedError(f"node {self.address} sent a bad report: {exc!r}") from exc
        if report is None:  # the stream's end: its status says why (a node stopping)
            try:
                await self._stream.recv_trailing_metadata()
            except (GRPCError, StreamTerminatedError, ProtocolError, *_CONNECT_ERRORS) as exc:
                raise self._error(exc) from exc
            raise NodeFailedError(f"node {self.address} ended its Watch stream")
        if isinstance(report, Refused):  # over the message limit (the codec's answer)
            raise NodeFailedError(f"node {self.address}: {report.reason}")
        self._reports += 1
        return cast("pb.DescribeResponse", report)

    async def aclose(self) -> None:
        """Close the connection, then the stream (which then waits for nothing)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._stream = None
        with contextlib.suppress(Exception):
            await self._stack.aclose()


@dataclass(slots=True)
class _PooledChannel:
    channel: Channel
    active: int = 0


class GrpcNode:
    """Connections to one node, opened lazily, reused across runs.

    Runs are spread over several HTTP/2 connections so that no connection
    carries more than `STREAMS_PER_CHANNEL` streams at once.
    """

    def __init__(self, where: NodeSocket, access: NodeAccess = _OPEN) -> None:
        self.where = where
        self.address = where.address
        # The token and TLS of every connection to the node.
        self.access = access
        self._channels: list[_PooledChannel] = []
        # Unary RPCs (CancelRun, Describe) on a connection of their own: on a run
        # connection a CancelRun could wait behind the node's stream limit (the
        # node may still count streams the edge has reset), past its own deadline.
        self._control: Channel | None = None

    def _acquire(self) -> _PooledChannel:
        best: _PooledChannel | None = None
        for pooled in self._channels:
            if pooled.active < STREAMS_PER_CHANNEL and (
                best is None or pooled.active < best.active
            ):
                best = pooled
        if best is None:
            best = _PooledChannel(open_channel(self.where, self.access))
            self._channels.append(best)
        best.active += 1
        return best

    def _release(self, pooled: _PooledChannel) -> None:
        pooled.active -= 1
        # Keep a few idle connections (a burst of new runs reuses
        # them); close the rest once drained.
        if pooled.active == 0:
            idle = sum(1 for p in self._channels if p.active == 0)
            if idle > IDLE_CHANNELS:
                self._channels.remove(pooled)
                pooled.channel.close()

    async def read_run(
        self,
        request: pb.RunRequest | EncodedRunRequest,
        sink: EventSink,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Run `request` on the node, marking `sink` sent once the request is written,
        then putting ACCEPTED and each event into it. Its caller starts it as a task of
        its own that trio's cancellation does not reach
        (`edge.node.bridge.call_asyncio_settled`): cancelled, it is never cut between a
        message's header and its body.

        `metadata` goes with the Run call (the trace context's `traceparent`).

        Returns once the node sent its terminal event (complete, error,
        cancelled). Raises an EdgeError when the node cannot be reached, the
        stream breaks, or it ends without a terminal event.

        The caller, cancelled, ends the task with `settle_read`: while the run's
        client left, the read goes on for SETTLE_PASSES passes of this loop (at
        most SETTLE_S) before the stream is reset: what the node sent before the
        edge gave up (in the connection's socket or grpclib's buffers, read and
        handed over in the loop's order) is taken, and a run whose terminal was on
        its way is over, not cancelled. Otherwise the stream is reset at once.
        """
        pooled = self._acquire()
        sent = accepted = terminal = False
        try:
            async with pooled.channel.request(
                RUN_ROUTE, Cardinality.UNARY_STREAM, type(request), RunEventDecoder,
                metadata=metadata,
            ) as stream:  # fmt: skip
                await stream.send_message(request, end=True)
                sent = True
                sink.mark_sent()
                await stream.recv_initial_metadata()
                accepted = True
                accept = _accepted(stream.initial_metadata)
                if not sink.put_nowait(accept):
                    await sink.put(accept)
                put_nowait = sink.put_nowait
                recv = cast("Callable[[], Awaitable[NodeEvent | Skip | None]]", stream.recv_message)
                while (event := await recv()) is not None:
                    if isinstance(event, Skip):
                        if type(event) is Refused:  # raised here: the message is gone
                            raise NodeFailedError(event.reason)
                        continue  # a RunEvent type this edge does not know
                    if not put_nowait(event):
                        await sink.put(event)
                    if isinstance(event, (Complete, Failed)):
                        terminal = True
                        break
            if not terminal:
                raise NodeFailedError(
                    f"node {self.address} ended the run's stream without a terminal event"
                )
        except EdgeError:
            raise
        except (GRPCError, StreamTerminatedError, ProtocolError, *_CONNECT_ERRORS) as exc:
            if terminal:
                return  # the trailers broke after the terminal event: nothing lost
            raise translate_error(exc, accepted=accepted, address=self.address, sent=sent) from exc
        except AttributeError as exc:
            if sent:
                raise  # not grpclib's opening of the stream: a bug
            raise translate_error(exc, accepted=False, address=self.address, sent=False) from exc
        finally:
            self._release(pooled)

    async def _unary(self, call: Callable[[pb.NodeServiceStub], Awaitable[T]]) -> T:
        """One unary RPC through the generated stub, on the control connection."""
        if self._control is None:
            self._control = open_channel(self.where, self.access)
        try:
            answer = await call(pb.NodeServiceStub(self._control))
        except (GRPCError, StreamTerminatedError, ProtocolError, *_CONNECT_ERRORS) as exc:
            raise translate_error(exc, accepted=False, address=self.address) from exc
        except Exception as exc:  # a malformed answer (protobuf decode), or any other surprise
            raise NodeFailedError(f"node {self.address} sent a bad answer: {exc!r}") from exc
        if isinstance(answer, Refused):  # over the message limit (the codec's answer)
            raise NodeFailedError(f"node {self.address}: {answer.reason}")
        return answer

    async def cancel_run(self, run_id: str, reason: str) -> bool:
        """CancelRun: True when the run was live on the node."""
        request = pb.CancelRunRequest(run_id=run_id, reason=reason)
        response = await self._unary(lambda stub: stub.cancel_run(request))
        return bool(response.found)

    async def describe(self) -> pb.DescribeResponse:
        return await self._unary(lambda stub: stub.describe(pb.DescribeRequest()))

    async def aclose(self) -> None:
        for pooled in self._channels:
            pooled.channel.close()
        self._channels.clear()
        if self._control is not None:
            self._control.close()
            self._control = None
