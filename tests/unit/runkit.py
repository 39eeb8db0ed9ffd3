"""Runs opened the way the product opens them, on a node the test plays.

A real `NodePool`, `Admission`, `Runs` and `Run` (its slot taken by admission,
opened by `Runs.open` from a `RunPlan`, entered to start), over a node client
whose `start_run` accepts at once and hands the test the run's event buffer:
the test plays the node by putting events there (`PlayedNode.events`), or
ending the run as the node client's read task would.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping

import trio

from edge.api.request import parse_chat_request
from edge.config import AdmissionConfig, TimeoutsConfig
from edge.fleet.admission import Admission
from edge.fleet.pool import NodePool
from edge.fleet.run import Run
from edge.fleet.runs import RunPlan, Runs
from edge.node.bridge import EventBuffer
from edge.node.client import GrpcNodeClient, NodeDescription, RunHandle
from edge.node.grpc import NodeSocket
from edge.node.wire import EncodedRunRequest, PreparedRunRequest
from edge.observe.metrics import EdgeMetrics
from edge.stream.session import SessionSettings, StreamSession

_BODY = b'{"model": "m", "stream": %s, "messages": [{"role": "user", "content": "hi"}]}'


Start = Callable[[trio.Nursery, EncodedRunRequest], Awaitable[RunHandle]]


class ScriptedClient:
    """A node whose runs start as the test scripts them (`start`)."""

    def __init__(self, name: str, start: Start) -> None:
        self.name = name
        self.address = name
        self._start = start

    async def start_run(
        self,
        nursery: trio.Nursery,
        request: EncodedRunRequest,
        *,
        deadline: float,
        slow_consumer_s: float = math.inf,
        accept_s: float = math.inf,
        metadata: Mapping[str, str] | None = None,
    ) -> RunHandle:
        return await self._start(nursery, request)

    async def describe(self) -> NodeDescription:  # pragma: no cover - never refreshed here
        raise AssertionError("not contacted")

    async def aclose(self) -> None:  # pragma: no cover
        pass


class PlayedNode(ScriptedClient):
    """A node that accepts every run at once; the test plays the node through the run's
    event buffer (`events`)."""

    def __init__(self, name: str = "node", max_events: int = 16, max_chars: int = 1 << 30):
        super().__init__(name, self._accept)
        self._buffer = (max_events, max_chars)
        self.handles: list[RunHandle] = []

    async def _accept(self, nursery: trio.Nursery, request: EncodedRunRequest) -> RunHandle:
        max_events, max_chars = self._buffer
        events = EventBuffer(max_events=max_events, max_chars=max_chars)
        handle = RunHandle(request.run_id, self.name, events)
        self.handles.append(handle)
        return handle

    @property
    def handle(self) -> RunHandle:
        """The last run's handle."""
        return self.handles[-1]

    @property
    def events(self) -> EventBuffer:
        """The last run's event buffer: what the node sent, as the read task puts it."""
        return self.handle.events


class RunKit:
    """A pool of played nodes serving model "m", its admission and its runs."""

    def __init__(self, timeouts: TimeoutsConfig, *nodes: PlayedNode) -> None:
        self.nodes = nodes or (PlayedNode(),)
        self.pool = NodePool(list(self.nodes), clock=trio.current_time)
        for state in self.pool.nodes:
            self.pool.feed.described(state, NodeDescription(state.client.name, ("m",)))
            state.max_runs = 4
        self.metrics = EdgeMetrics()
        self.admission = Admission(self.pool, AdmissionConfig(), self.metrics)
        self.timeouts = timeouts
        self.runs = Runs(self.pool, timeouts, self.metrics, self.admission)

    async def run(
        self,
        nursery: trio.Nursery | None = None,
        *,
        stream: bool = True,
        keepalive_s: float = 0.0,
        settings: SessionSettings | None = None,
    ) -> Run:
        """A run of a request for "m" on the first node, its slot taken, entered (the
        node accepted it). `nursery`: where its read task would go (a played node starts
        none): by default the one the calling task runs in."""
        if nursery is None:
            nursery = trio.lowlevel.current_task().parent_nursery
            assert nursery is not None
        request = parse_chat_request(_BODY % (b"true" if stream else b"false"))
        node = await self.admission.acquire("m")
        plan = RunPlan(
            request, PreparedRunRequest(b"", "r1"), trio.current_time() + self.timeouts.total_s,
            keepalive_s=keepalive_s, timeouts=self.timeouts,
        )  # fmt: skip
        session = StreamSession(settings or SessionSettings(run_id="r1"))
        run = self.runs.open(node, nursery, plan, session)
        return await run.__aenter__()


class PlayedClient(GrpcNodeClient):
    """The product's gRPC node client, its node side played in this process: `play` runs
    each run's node side in the run's read task (into its event buffer), and CancelRuns
    are counted per run (by its handle's id) instead of sent."""

    def __init__(self, name: str) -> None:
        super().__init__(name, NodeSocket.tcp("127.0.0.1", 1))
        self.cancels: dict[int, int] = {}

    async def play(self, events: EventBuffer) -> None:
        raise NotImplementedError

    async def read_events(
        self,
        handle: RunHandle,
        request: object,
        events: EventBuffer,
        metadata: Mapping[str, str] | None,
    ) -> None:
        await self.play(events)

    async def cancel_on_node(self, handle: RunHandle) -> None:
        assert not handle.finished, "a CancelRun for a run the node ended"
        self.cancels[id(handle)] = self.cancels.get(id(handle), 0) + 1
