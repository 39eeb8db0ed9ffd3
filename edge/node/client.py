"""Nodes as the rest of the edge sees them: `NodeClient` and `RunHandle`.

A run is started with `start_run`, which returns once the node has accepted
it (or raises NodeUnavailableError / NodeFailedError, so the HTTP layer can
still choose a status). The run's events then arrive on `RunHandle.events`,
read by one task in the caller's nursery (the run's own request scope).
`RunHandle.cancel(cause)` is the only way to end a run early: synchronous,
idempotent, first cause wins. CancelRun is sent from exactly one place, the
read task's cleanup, and only when the node did not end the run itself: a
run whose terminal event reached the edge is finished, even if nobody read
that event yet. A run whose client left first reads on a little (`settling`:
a few passes of the asyncio loop, bounded), so that a terminal the node had
already sent, still in the connection, ends it as the node ended it.

`NodeClient.watch` is the node's Watch stream as an async iterator of checked
`NodeDescription`s (`edge.node.describe`), one subscription on a connection
of its own; leaving the iterator closes it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import AsyncGenerator, Callable, Mapping
from functools import partial
from typing import Protocol

import trio
from loguru import logger

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.routes import MAX_MESSAGE_BYTES
from edge.errors import (
    EdgeError,
    NodeFailedError,
    NodeTimeoutError,
    NodeUnavailableError,
    PayloadTooLargeError,
)
from edge.node.access import NodeAccess
from edge.node.backlog import Backlog
from edge.node.bridge import EventBuffer, call_asyncio, call_asyncio_settled
from edge.node.describe import NodeDescription as NodeDescription
from edge.node.describe import description_from_pb
from edge.node.grpc import Accepted, GrpcNode, NodeWatch, settle_read
from edge.node.grpc import NodeSocket as NodeSocket
from edge.node.grpc import WatchUnsupported as WatchUnsupported
from edge.node.wire import EncodedRunRequest
from edge.observe.logbound import clip

# Events buffered between the node's read loop and the stream's writer, in
# count and in characters of delta text; past either the read loop waits and
# HTTP/2 flow control slows the node down. A client that stops reading holds
# this much here, one batch (edge.fleet.run.MAX_BATCH_CHARS) and the node
# connection's stream window (edge.node.grpc). 64 Ki characters is seconds of
# output at any model's rate; one delta larger than it still passes, alone.
EVENT_BUFFER = 512
EVENT_BUFFER_CHARS = 64 * 1024
CANCEL_RPC_TIMEOUT_S = 2.0
# Run ids a line about failed CancelRuns names (then "and N more").
CANCEL_FAILED_NAMED = 32
# CancelRuns in flight per node at once (on the node client's control connection,
# under a node's limit of 100 streams there), and how long one may wait its turn.
CANCEL_CONCURRENCY = 64
CANCEL_QUEUE_S = 10.0
DESCRIBE_TIMEOUT_S = 2.0


def _detached(error: EdgeError) -> EdgeError:
    """`error` as a run keeps it: without its traceback, cause and context.

    Their frames hold what the failing code held (the run's request, a node's
    message), and a frame that also holds the run's handle ties them into a
    cycle with the stored error, which only a full garbage collection frees:
    a kept error keeps its type and message, nothing else.
    """
    error.__traceback__ = None
    error.__cause__ = error.__context__ = None
    return error


class EndCause(enum.StrEnum):
    """Why the edge ended a run before the node did; the value is CancelRun's reason."""

    CLIENT_GONE = "client_disconnected"  # the caller left (or its request was cut)
    TIMEOUT = "timeout"  # a deadline passed: accept, first event, idle, total
    SLOW_CLIENT = "slow_client"  # output waited slow_client_s for a reader
    SHUTDOWN = "shutdown"  # the drain deadline passed
    STREAM_BROKEN = "stream_broken"  # the node's stream broke (CancelRun just in case)


class RunHandle:
    """One run on a node, from acceptance to its end.

    Attributes:
        events: our node events, in order; closed when the read task ends.
        error: set when the node's stream broke (the fail-stream path).
        cause: why the edge ended the run early (None: the node ended it),
            final once `events` is closed.
        finished: the node ended the run itself (its terminal reached the edge).
        done: set once the read task is over, CancelRun included.
    """

    __slots__ = (
        "_scope", "cause", "done", "error", "events", "finished", "instance", "node_name",
        "run_id",
    )  # fmt: skip

    def __init__(
        self, run_id: str, node_name: str, events: EventBuffer, *, deadline: float = math.inf
    ) -> None:
        self.run_id = run_id
        self.node_name = node_name
        self.events = events
        self.error: EdgeError | None = None
        self.cause: EndCause | None = None
        self.finished = False
        # The life of the node's process that accepted the run (its instance id; "":
        # not accepted yet, or the node does not say).
        self.instance = ""
        self.done = trio.Event()
        # The read task's scope; its deadline is the run's total deadline.
        self._scope = trio.CancelScope(deadline=deadline)

    def cancel(self, cause: EndCause | str) -> None:
        """End the run early. Idempotent; the first cause wins; never blocks."""
        if self.cause is None and not self.finished:
            self.cause = EndCause(cause)
        self._scope.cancel()
        self.events.abort()

    def settling(self) -> bool:
        """The read task was cancelled: whether its read goes on a little first
        (`edge.node.grpc.SETTLE_PASSES`), to take what the node already sent.

        Yes when the run's client left (CLIENT_GONE, or the request was cut
        from outside before its deadline): a run whose terminal was on its way
        ends as the node ended it, without a CancelRun. No for a deadline, a
        slow client or shutdown: those end the run at once. Settling, nobody
        reads the events any more: they are dropped as they come.
        """
        if self.cause is None:
            settles = trio.current_time() < self._scope.deadline
        else:
            settles = self.cause is EndCause.CLIENT_GONE
        if settles:
            self.events.abort()
        return settles


class NodeClient(Protocol):
    """A node the edge can run models on."""

    name: str
    address: str

    async def start_run(
        self,
        nursery: trio.Nursery,
        request: pb.RunRequest | EncodedRunRequest,
        *,
        deadline: float,
        slow_consumer_s: float = math.inf,
        accept_s: float = math.inf,
        metadata: Mapping[str, str] | None = None,
    ) -> RunHandle: ...

    async def describe(self) -> NodeDescription: ...

    def watch(self, heartbeat_s: float) -> AsyncGenerator[NodeDescription, None]:
        """The node's reports, pushed (Watch): one at once, then as its state changes
        and at least every `heartbeat_s` (what it keeps is each report's heartbeat_ms).
        Raises WatchUnsupported for a node older than Watch, an EdgeError when the
        stream breaks or a report is past a bound. Close it (`contextlib.aclosing`)."""
        ...

    async def aclose(self) -> None: ...


class GrpcNodeClient:
    """A NodeClient over grpclib, through the trio-asyncio bridge."""

    def __init__(
        self,
        name: str,
        where: NodeSocket,
        *,
        on_cancel_sent: Callable[[], object] | None = None,
        backlog: Backlog | None = None,
        on_state_rpc: Callable[[str], object] | None = None,
        access: NodeAccess | None = None,
    ) -> None:
        """`where`: the node's TCP address, or the Unix socket of a node served in this
        process (`NodeSocket`). `backlog`: the process's, shared by every node client
        (`edge.process.daemon`); without it the client's runs count on a backlog of their
        own, with no budget.
        `on_state_rpc` hears each Describe ("describe") and Watch ("watch") sent.
        `access`: the token and TLS of every call (`edge.node.access`; None: neither)."""
        self.name = name
        self.address = where.address
        self._grpc = GrpcNode(where, access or NodeAccess())
        self._on_cancel_sent = on_cancel_sent
        self._on_state_rpc = on_state_rpc
        self._backlog = Backlog() if backlog is None else backlog
        self._cancel_limiter = trio.CapacityLimiter(CANCEL_CONCURRENCY)
        # Failed CancelRuns not logged yet (a burst is one line a second), and the
        # first CANCEL_FAILED_NAMED of their run ids.
        self._cancel_failures = 0
        self._cancel_failed_ids: list[str] = []
        self._cancel_failure = ""
        self._cancel_warned_at = -math.inf

    async def start_run(
        self,
        nursery: trio.Nursery,
        request: pb.RunRequest | EncodedRunRequest,
        *,
        deadline: float,
        slow_consumer_s: float = math.inf,
        accept_s: float = math.inf,
        metadata: Mapping[str, str] | None = None,
    ) -> RunHandle:
        """Start `request` in `nursery`; return once the node accepted it.

        `metadata` goes with the Run call (the trace context: `edge.observe.tracing`).

        A request over the nodes' gRPC message limit is refused at once
        (PayloadTooLargeError, a 413): the node would refuse it anyway.

        A node that has not accepted the run within `accept_s` of its RunRequest
        written to the connection, or a RunRequest not written within `accept_s`
        (the node unreachable, or the loop behind), fails it with NodeTimeoutError
        (the run is cancelled, EndCause.TIMEOUT). When this
        raises, the read task is over (its CancelRun included).

        `deadline` (trio clock) bounds the whole run: past it the run is
        cancelled (EndCause.TIMEOUT). A consumer that takes no event for
        `slow_consumer_s` while events wait is gone (EndCause.SLOW_CLIENT), and
        so is one whose run waits for room while the process's backlog is past
        its budget, the longest waiting first (`edge.node.backlog`).
        """
        if isinstance(request, EncodedRunRequest) and len(request) > MAX_MESSAGE_BYTES:
            # The node would refuse it (gRPC's 4 MiB limit): say so before starting.
            raise PayloadTooLargeError(
                f"the request is {len(request)} bytes as a RunRequest, over the"
                f" {MAX_MESSAGE_BYTES}-byte gRPC message limit of the nodes"
            )
        events = EventBuffer(
            max_events=EVENT_BUFFER, max_chars=EVENT_BUFFER_CHARS, limit_s=slow_consumer_s,
            backlog=self._backlog,
        )  # fmt: skip
        handle = RunHandle(request.run_id, self.name, events, deadline=deadline)
        # The read task leaves the backlog when it ends, whatever ends it (`_run`).
        nursery.start_soon(self._run, handle, request, events, metadata)
        try:
            accepted = await self._accepted(handle, events, accept_s)
        except BaseException as exc:
            if not isinstance(exc, EdgeError):
                handle.cancel(EndCause.CLIENT_GONE)
            # A run that did not start leaves nothing behind: its read task (and
            # CancelRun, shielded and bounded) is over when this raises.
            with trio.CancelScope(shield=True):
                await handle.done.wait()
            raise
        handle.instance = accepted.instance
        return handle

    async def _accepted(self, handle: RunHandle, events: EventBuffer, accept_s: float) -> Accepted:
        """Wait for the node's acceptance of the run: `accept_s` to write the RunRequest
        (a connection to make first; grpclib can park a request on a connection that is
        then lost until a deadline: vmagamedov/grpclib#216), then `accept_s` from there
        for the node to accept it. Raises as `start_run` says."""
        try:
            limit = trio.current_time() + accept_s
            while True:
                with trio.move_on_at(limit) as waiting:
                    first = await events.receive_start()
                if not waiting.cancelled_caught:
                    break
                sent_at = events.sent_at
                if sent_at is not None and sent_at + accept_s > limit:
                    limit = sent_at + accept_s  # written late: its wait counts from then
                    continue
                handle.cancel(EndCause.TIMEOUT)
                late = NodeTimeoutError(
                    f"node {self.name} did not accept the run in {accept_s}s"
                    if sent_at is not None else f"the run could not be sent to node"
                    f" {self.name} in {accept_s}s"
                )  # fmt: skip
                late.sent = sent_at is not None
                raise late
        except trio.EndOfChannel:
            if handle.error is not None:
                raise handle.error from None
            if handle.cause is EndCause.TIMEOUT:  # the run's total deadline came first
                raise NodeTimeoutError(
                    f"node {self.name} did not accept the run before its deadline"
                ) from None
            raise NodeFailedError(f"node {self.name} ended the run before accepting it") from None
        assert isinstance(first, Accepted)
        return first

    async def _run(
        self,
        handle: RunHandle,
        request: pb.RunRequest | EncodedRunRequest,
        events: EventBuffer,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """The run's read task: node events into `events`, then CancelRun if needed.

        Cancelled through the handle (a cause is set first), by the run's total
        deadline (TIMEOUT), or from outside by the end of the nursery it runs
        in: the request it serves was cut (CLIENT_GONE).

        Whatever ends it, the run's buffer leaves the process's backlog here,
        once; a run the edge ended also drops the events nobody will read.
        """
        try:
            with handle._scope:
                try:
                    await self.read_events(handle, request, events, metadata)
                except EdgeError as exc:
                    handle.error = _detached(exc)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    handle.cancel(EndCause.CLIENT_GONE)
                except trio.TooSlowError:
                    logger.warning(
                        "run {}: the client stopped reading{}; cancelling", handle.run_id,
                        " (over the backlog budget)" if events.cut_by_backlog else "",
                    )  # fmt: skip
                    handle.cancel(EndCause.SLOW_CLIENT)
                except Exception as exc:  # a bug, not a node failure: keep the edge serving
                    logger.opt(exception=exc).error("run {} failed in the edge", handle.run_id)
                    handle.error = NodeFailedError("the edge failed while reading the run")
        finally:
            # The node's terminal reached the edge: the node ended the run.
            handle.finished = events.terminal
            if not handle.finished and handle.cause is None and handle.error is None:
                expired = handle._scope.cancelled_caught
                handle.cause = EndCause.TIMEOUT if expired else EndCause.CLIENT_GONE
            # The cause is final: now the writer may see the end of the events.
            events.release()
            events.close()
            if handle.cause is not None:  # ended by the edge: nobody reads the rest
                events.clear()
            try:
                if not handle.finished and not isinstance(handle.error, NodeUnavailableError):
                    await self.cancel_on_node(handle)
            finally:
                handle.done.set()

    async def read_events(
        self,
        handle: RunHandle,
        request: pb.RunRequest | EncodedRunRequest,
        events: EventBuffer,
        metadata: Mapping[str, str] | None,
    ) -> None:
        """The run's read: marked sent, ACCEPTED, then the node's events into `events`, up to
        its terminal (`edge.node.grpc.GrpcNode.read_run`). A client whose runs go
        another way than the Run call reads them here (`edge.nodes.direct`)."""
        settle = partial(settle_read, settles=handle.settling)
        await call_asyncio_settled(self._grpc.read_run(request, events, metadata), settle)

    async def cancel_on_node(self, handle: RunHandle) -> None:
        """Send CancelRun, shielded and bounded: the run's read ended without the node's
        terminal (a client whose runs go another way ends them its own way).

        A burst (thousands of clients leaving at once) queues on a limiter
        instead of opening thousands of RPCs; a run waits at most
        CANCEL_QUEUE_S for its turn and CANCEL_RPC_TIMEOUT_S for the RPC.
        """
        reason = str(handle.cause or EndCause.STREAM_BROKEN)
        failure: str | None = None
        with trio.CancelScope(shield=True):
            with trio.move_on_after(CANCEL_QUEUE_S) as queued:
                async with self._cancel_limiter:
                    if self._on_cancel_sent is not None:
                        self._on_cancel_sent()
                    with trio.move_on_after(CANCEL_RPC_TIMEOUT_S) as rpc:
                        try:
                            await call_asyncio(self._grpc.cancel_run, handle.run_id, reason)
                        except Exception as exc:
                            failure = str(exc) or type(exc).__name__
                    if rpc.cancelled_caught:
                        failure = f"no answer within {CANCEL_RPC_TIMEOUT_S}s"
            if queued.cancelled_caught and failure is None:
                failure = f"still queued after {CANCEL_QUEUE_S}s"
        if failure is not None:
            self._cancel_failed(handle.run_id, failure)

    def _cancel_failed(self, run_id: str, failure: str) -> None:
        """Log failed CancelRuns, at most one line a second per node (a burst is one line,
        naming its first runs); what is left at the end is logged by `aclose`."""
        self._cancel_failures += 1
        if len(self._cancel_failed_ids) < CANCEL_FAILED_NAMED:
            self._cancel_failed_ids.append(run_id)
        self._cancel_failure = failure
        if trio.current_time() - self._cancel_warned_at >= 1.0:
            self._log_cancel_failures()

    def _log_cancel_failures(self) -> None:
        count, named = self._cancel_failures, self._cancel_failed_ids
        more = f" and {count - len(named)} more" if count > len(named) else ""
        logger.warning(
            "CancelRun to node {} failed for {} run(s) ({}{}), last: {}",
            self.name, count, " ".join(named), more, clip(self._cancel_failure),
        )  # fmt: skip
        self._cancel_failures = 0
        self._cancel_failed_ids = []
        self._cancel_warned_at = trio.current_time()

    async def describe(self) -> NodeDescription:
        if self._on_state_rpc is not None:
            self._on_state_rpc("describe")
        with trio.fail_after(DESCRIBE_TIMEOUT_S):
            response = await call_asyncio(self._grpc.describe)
        return description_from_pb(response, self.name, self.address)

    async def watch(self, heartbeat_s: float) -> AsyncGenerator[NodeDescription, None]:
        """One Watch subscription (see `NodeClient.watch`). Bounded in nothing but its
        reports: how long to wait for one is the caller's (the pool's silence bound)."""
        if self._on_state_rpc is not None:
            self._on_state_rpc("watch")
        watch = NodeWatch(self._grpc.where, self._grpc.access)
        try:
            await call_asyncio(watch.open, max(1, round(heartbeat_s * 1000)))
            while True:
                report = await call_asyncio(watch.next)
                yield description_from_pb(report, self.name, self.address)
        finally:
            with trio.CancelScope(shield=True):
                await call_asyncio(watch.aclose)

    async def aclose(self) -> None:
        if self._cancel_failures:
            self._log_cancel_failures()
        with trio.CancelScope(shield=True):
            await call_asyncio(self._grpc.aclose)
