"""The simulated node: a real grpclib server implementing the node contract.

It runs on asyncio, standalone (`iop-sim-node`) or on the asyncio loop the
edge hosts (a node whose address is "embedded"). Models:

- `sim-echo`: streams the last user message back word by word.
- `sim-script`: plays the last user message, `{"events": [...]}`, item by item:
  a RunEvent as JSON, `{"sleep_ms": N}`, `{"type": "hang"}` (wait until
  cancelled), or `{"type": "abort"}` (break the stream, no terminal event).
  A delta item may carry `"repeat": N` to send the same delta N times (the
  benchmarks' fast path).

The runs log gets one JSON line per run when it ends: run_id, model, outcome
(complete | error | cancelled | aborted | ended), cancel_rpc, cancel_rpcs,
events_sent. A run that ends without CancelRun waits a short grace period
for one before its line is written, so a CancelRun racing the stream reset
is still recorded on the run. A CancelRun for an id the node does not know
is logged as `{"type": "cancel_rpc", "run_id": ..., "found": false}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from grpclib.const import Cardinality, Handler, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol
from grpclib.server import Server, Stream
from h2.settings import SettingCodes

from edge.node._proto.iop.node import v1 as pb

MODELS = ("sim-echo", "sim-script")
RUN_ROUTE = "/iop.node.v1.NodeService/Run"
CANCEL_ROUTE = "/iop.node.v1.NodeService/CancelRun"
DESCRIBE_ROUTE = "/iop.node.v1.NodeService/Describe"
# Raised from grpclib's default of 100 so one edge connection can carry many runs.
MAX_CONCURRENT_STREAMS = 100_000
CANCEL_GRACE_S = 1.0
# A repeated event yields to the loop every this many messages.
YIELD_EVERY = 8


@dataclass(slots=True)
class _Run:
    run_id: str
    model: str
    task: asyncio.Task[Any] | None
    events_sent: int = 0
    cancel_rpcs: int = 0
    outcome: str | None = None
    ended_at: float = 0.0
    flush_handle: asyncio.TimerHandle | None = field(default=None, repr=False)


class ScriptError(ValueError):
    """The sim-script message is not a valid script."""


def _last_user_text(request: pb.RunRequest) -> str:
    for message in reversed(request.messages):
        if message.role == "user":
            if message.content is not None:
                return str(message.content)
            return "".join(p.text for p in message.parts if p.type == "text")
    return ""


def _event_from_json(item: dict[str, Any]) -> pb.RunEvent:
    usage = item.get("usage")
    metadata = {
        str(k): v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
        for k, v in (item.get("metadata") or {}).items()
    }
    return pb.RunEvent(
        type=str(item.get("type", "")),
        delta=str(item.get("delta", "")),
        error=str(item.get("error", "")),
        message=str(item.get("message", "")),
        usage=pb.Usage(**{k: int(v) for k, v in usage.items()}) if usage else None,
        metadata=metadata,
    )


def parse_script(text: str) -> list[dict[str, Any]]:
    """The items of a sim-script message; raises ScriptError when it is not one."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScriptError(f"sim-script: the last user message is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("events"), list):
        raise ScriptError('sim-script: expected {"events": [...]}')
    items: list[dict[str, Any]] = doc["events"]
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ScriptError(f"sim-script: events[{i}] is not an object")
    return items


class _Encoded(bytes):
    """A message serialized already: the codec sends it as it is."""


class _Codec(ProtoCodec):
    def encode(self, message: Any, message_type: Any) -> bytes:
        if type(message) is _Encoded:
            return message
        return super().encode(message, message_type)


class _Protocol(H2Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        h2_conn = self.connection._connection
        h2_conn.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS})
        self.connection.flush()


class _Server(Server):
    def _protocol_factory(self) -> H2Protocol:
        proto = super()._protocol_factory()
        return _Protocol(proto.handler, proto.config, proto.h2_config)


class SimNode:
    """The NodeService of the simulated node."""

    def __init__(self, name: str = "iop-sim-node", runs_log: Path | None = None) -> None:
        self.name = name
        self._runs: dict[str, _Run] = {}
        self._log: IO[str] | None = runs_log.open("a", buffering=1) if runs_log else None
        self.finished: list[dict[str, Any]] = []  # every run's log record, in-process users

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
        return sum(1 for run in self._runs.values() if run.outcome is None)

    # --- RPCs -------------------------------------------------------------------

    async def _describe(self, stream: Stream[pb.DescribeRequest, pb.DescribeResponse]) -> None:
        await stream.recv_message()
        await stream.send_message(
            pb.DescribeResponse(
                node_name=self.name,
                models=[pb.ModelInfo(id=m, owned_by="iop-sim") for m in MODELS],
                active_runs=self.active_runs,
            )
        )

    async def _cancel_run(self, stream: Stream[pb.CancelRunRequest, pb.CancelRunResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        run = self._runs.get(request.run_id)
        found = run is not None and run.outcome is None
        if run is None:
            self._write({"type": "cancel_rpc", "run_id": request.run_id, "found": False})
        else:
            run.cancel_rpcs += 1
            if run.outcome is None and run.task is not None:
                run.task.cancel()
            elif run.flush_handle is not None:
                # Ended already (stream reset first): record now, not after the grace.
                run.flush_handle.cancel()
                self._flush(run)
        await stream.send_message(pb.CancelRunResponse(found=found))

    async def _run(self, stream: Stream[pb.RunRequest, pb.RunEvent]) -> None:
        request = await stream.recv_message()
        assert request is not None
        await stream.send_initial_metadata()
        run = _Run(request.run_id, request.model, asyncio.current_task())
        self._runs[run.run_id] = run
        try:
            outcome = await self._play(stream, request, run)
            run.outcome = outcome
        except asyncio.CancelledError:
            run.outcome = "cancelled"
            if run.cancel_rpcs and not stream._cancel_done:
                # CancelRun arrived while the caller still reads: tell it.
                with contextlib.suppress(Exception):
                    await stream.send_message(pb.RunEvent(type="cancelled", error="run cancelled"))
                    run.events_sent += 1
                    return
            raise
        except GRPCError:
            raise
        except ScriptError as exc:
            run.outcome = "error"
            await stream.send_message(pb.RunEvent(type="error", error=str(exc)))
            run.events_sent += 1
        finally:
            if run.outcome is None:
                run.outcome = "error"
            self._ended(run)

    async def _send(
        self, stream: Stream[pb.RunRequest, pb.RunEvent], run: _Run, ev: pb.RunEvent
    ) -> None:
        await stream.send_message(ev)
        run.events_sent += 1

    async def _play(
        self, stream: Stream[pb.RunRequest, pb.RunEvent], request: pb.RunRequest, run: _Run
    ) -> str:
        if request.model == "sim-echo":
            return await self._echo(stream, request, run)
        if request.model == "sim-script":
            return await self._script(stream, parse_script(_last_user_text(request)), run)
        await self._send(
            stream,
            run,
            pb.RunEvent(type="error", error=f"model {request.model!r} is not served here"),
        )
        return "error"

    async def _echo(
        self, stream: Stream[pb.RunRequest, pb.RunEvent], request: pb.RunRequest, run: _Run
    ) -> str:
        text = _last_user_text(request)
        words = text.split(" ")
        for i, word in enumerate(words):
            await self._send(
                stream, run, pb.RunEvent(type="delta", delta=word if i == 0 else " " + word)
            )
        prompt_tokens = sum(len((m.content or "").split()) for m in request.messages)
        usage = pb.Usage(input_tokens=prompt_tokens, output_tokens=len(words))
        await self._send(
            stream,
            run,
            pb.RunEvent(type="complete", usage=usage, metadata={"finish_reason": "stop"}),
        )
        return "complete"

    async def _send_repeated(
        self, stream: Stream[pb.RunRequest, pb.RunEvent], run: _Run, event: pb.RunEvent, n: int
    ) -> None:
        """The benchmarks' fast path: serialize once, send the bytes n times."""
        payload = _Encoded(bytes(event))
        send = stream.send_message
        for i in range(n):
            await send(payload)
            run.events_sent += 1
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                # send_message does not yield while the window is open: never
                # starve other RPCs (CancelRun among them).
                await asyncio.sleep(0)

    async def _script(
        self, stream: Stream[pb.RunRequest, pb.RunEvent], items: list[dict[str, Any]], run: _Run
    ) -> str:
        for item in items:
            if "sleep_ms" in item:
                await asyncio.sleep(float(item["sleep_ms"]) / 1000)
                continue
            kind = item.get("type")
            if kind == "hang":
                await asyncio.Event().wait()
            if kind == "abort":
                run.outcome = "aborted"
                # Non-OK trailers: the events sent so far still arrive, in order.
                raise GRPCError(Status.ABORTED, "simulated abort")
            event = _event_from_json(item)
            repeat = int(item.get("repeat", 1))
            if repeat > 1:
                await self._send_repeated(stream, run, event, repeat)
            else:
                await self._send(stream, run, event)
            if kind in ("complete", "error", "cancelled"):
                return "complete" if kind == "complete" else str(kind)
        return "ended"

    # --- the runs log -----------------------------------------------------------

    def _ended(self, run: _Run) -> None:
        run.task = None
        run.ended_at = time.time()
        if run.outcome in ("complete", "error") or run.cancel_rpcs:
            self._flush(run)
        else:
            loop = asyncio.get_running_loop()
            run.flush_handle = loop.call_later(CANCEL_GRACE_S, self._flush, run)

    def _flush(self, run: _Run) -> None:
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
        if self._log is not None:
            self._log.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        for run in list(self._runs.values()):
            if run.flush_handle is not None:
                run.flush_handle.cancel()
                self._flush(run)
        if self._log is not None:
            self._log.close()
            self._log = None


async def start_server(node: SimNode, host: str, port: int) -> tuple[Server, int]:
    """Start serving `node`; returns the server and the port it listens on."""
    server = _Server([node], codec=_Codec())
    await server.start(host, port, backlog=2048, reuse_address=True)
    listening = server._server
    assert isinstance(listening, asyncio.Server)
    bound = listening.sockets[0].getsockname()[1]
    return server, int(bound)


async def stop_server(node: SimNode, server: Server) -> None:
    server.close()
    await server.wait_closed()
    node.close()
