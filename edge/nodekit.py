"""What the node implementations in this repo share: the simulated node and iop-node.

- `NodeServer`: a grpclib server that lifts HTTP/2 MAX_CONCURRENT_STREAMS
  from grpclib's 100, so one edge connection can carry many runs, and
  refuses a received message over gRPC's default 4 MiB (`BoundedCodec`).
- `NodeService`: the routing of the three RPCs, CancelRun, and the runs log;
  a node serves Run and Describe.
- `RunsLog`: the runs in flight and the runs log, one JSON line per run when
  it ends: run_id, model, outcome, cancel_rpc, cancel_rpcs, events_sent. A run
  that ended without CancelRun waits CANCEL_GRACE_S for one (a CancelRun
  races the stream reset) before its line is written; a CancelRun for an id
  the node does not know is logged as {"type": "cancel_rpc", "found": false}.

Node side only (asyncio, grpclib); the edge itself never imports this.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from grpclib.const import Cardinality, Handler, Status
from grpclib.encoding.base import CodecBase
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol
from grpclib.server import Server, Stream
from h2.settings import SettingCodes

from edge.node._proto.iop.node import v1 as pb

MAX_CONCURRENT_STREAMS = 100_000
# gRPC's default limit on a received message (the edge enforces the same).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
CANCEL_GRACE_S = 1.0
RUN_ROUTE = "/iop.node.v1.NodeService/Run"
CANCEL_ROUTE = "/iop.node.v1.NodeService/CancelRun"
DESCRIBE_ROUTE = "/iop.node.v1.NodeService/Describe"

Events = Stream[pb.RunRequest, pb.RunEvent]


class _Protocol(H2Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        h2_conn = self.connection._connection
        h2_conn.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS})
        self.connection.flush()


class BoundedCodec(ProtoCodec):
    """grpclib's protobuf codec, refusing a received message over MAX_MESSAGE_BYTES.

    grpclib 0.4.9 (the latest release) has no receive limit of its own
    (vmagamedov/grpclib#195, open); the codec is the first public place that
    sees a received message. The RPC ends with RESOURCE_EXHAUSTED, as gRPC's
    own limit answers.
    """

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > MAX_MESSAGE_BYTES:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"received message larger than max ({len(data)} vs. {MAX_MESSAGE_BYTES})",
            )
        return super().decode(data, message_type)


class NodeServer(Server):
    """A grpclib server whose connections accept MAX_CONCURRENT_STREAMS streams.

    Its codec is a `BoundedCodec` unless the caller passes one (which should
    derive from it).
    """

    def __init__(
        self, handlers: Collection[NodeService], *, codec: CodecBase | None = None
    ) -> None:
        super().__init__(handlers, codec=codec if codec is not None else BoundedCodec())

    def _protocol_factory(self) -> H2Protocol:
        proto = super()._protocol_factory()
        return _Protocol(proto.handler, proto.config, proto.h2_config)


async def wait_for_stop_signal() -> None:
    """Return on SIGTERM or SIGINT (a node run as its own process)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def bound_port(server: Server) -> int:
    """The port a started server listens on (for port 0)."""
    listening = server._server
    assert isinstance(listening, asyncio.Server)
    return int(listening.sockets[0].getsockname()[1])


@dataclass(slots=True)
class RunRecord:
    """One run on a node, from Run to its runs-log line."""

    run_id: str
    model: str
    # What CancelRun stops (the handler's task, or a task of its own).
    task: asyncio.Task[Any] | None = None
    events_sent: int = 0
    cancel_rpcs: int = 0
    outcome: str | None = None
    flush_handle: asyncio.TimerHandle | None = field(default=None, repr=False)


class RunsLog:
    """The runs of one node: which are live, and the log line of each that ended."""

    def __init__(self, path: Path | None = None) -> None:
        self._runs: dict[str, RunRecord] = {}
        self._file: IO[str] | None = path.open("a", buffering=1) if path else None
        self.finished: list[dict[str, Any]] = []  # every record written, for in-process users

    @property
    def active(self) -> int:
        return sum(1 for run in self._runs.values() if run.outcome is None)

    def start(self, run_id: str, model: str) -> RunRecord:
        run = RunRecord(run_id, model)
        self._runs[run_id] = run
        return run

    def cancel_rpc(self, run_id: str) -> tuple[RunRecord | None, bool]:
        """Record a CancelRun. Returns (the live run to stop or None, whether it was live)."""
        run = self._runs.get(run_id)
        if run is None:
            self._write({"type": "cancel_rpc", "run_id": run_id, "found": False})
            return None, False
        run.cancel_rpcs += 1
        if run.outcome is None:
            return run, True
        if run.flush_handle is not None:
            # Ended already (the stream reset came first): record now, not after the grace.
            run.flush_handle.cancel()
            self._flush(run)
        return None, False

    def ended(self, run: RunRecord) -> None:
        """The run is over (its outcome set): write its line now, or after the grace."""
        run.task = None
        if run.outcome in ("complete", "error") or run.cancel_rpcs:
            self._flush(run)
        else:
            loop = asyncio.get_running_loop()
            run.flush_handle = loop.call_later(CANCEL_GRACE_S, self._flush, run)

    def _flush(self, run: RunRecord) -> None:
        if self._runs.pop(run.run_id, None) is None:
            return
        self._write(
            {
                "run_id": run.run_id,
                "model": run.model,
                "outcome": run.outcome,
                "cancel_rpc": run.cancel_rpcs > 0,
                "cancel_rpcs": run.cancel_rpcs,
                "events_sent": run.events_sent,
            }
        )

    def _write(self, record: dict[str, Any]) -> None:
        self.finished.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Write the lines still waiting for their grace, then close the file."""
        for run in list(self._runs.values()):
            if run.flush_handle is not None:
                run.flush_handle.cancel()
                self._flush(run)
        if self._file is not None:
            self._file.close()
            self._file = None


class NodeService:
    """A node's NodeService: subclasses implement `_run` and `_describe`.

    CancelRun is common: it is recorded in the runs log, and a live run's
    task is stopped with `stop_task` (a subclass may stop it its own way).
    """

    def __init__(self, name: str, runs_log: Path | None = None) -> None:
        self.name = name
        self.runs = RunsLog(runs_log)

    def __mapping__(self) -> dict[str, Handler]:
        return {
            RUN_ROUTE: Handler(self._run, Cardinality.UNARY_STREAM, pb.RunRequest, pb.RunEvent),
            CANCEL_ROUTE: Handler(
                self._cancel_run, Cardinality.UNARY_UNARY, pb.CancelRunRequest, pb.CancelRunResponse
            ),
            DESCRIBE_ROUTE: Handler(
                self._describe, Cardinality.UNARY_UNARY, pb.DescribeRequest, pb.DescribeResponse
            ),
        }

    @property
    def active_runs(self) -> int:
        return self.runs.active

    @property
    def finished(self) -> list[dict[str, Any]]:
        """Every runs-log record written so far (for in-process users)."""
        return self.runs.finished

    async def _run(self, stream: Events) -> None:
        raise NotImplementedError

    async def _describe(self, stream: Stream[pb.DescribeRequest, pb.DescribeResponse]) -> None:
        raise NotImplementedError

    def stop_task(self, task: asyncio.Task[Any]) -> None:
        task.cancel()

    async def _cancel_run(self, stream: Stream[pb.CancelRunRequest, pb.CancelRunResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        run, found = self.runs.cancel_rpc(request.run_id)
        if run is not None and run.task is not None:
            self.stop_task(run.task)
        await stream.send_message(pb.CancelRunResponse(found=found))
