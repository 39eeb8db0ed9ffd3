"""The runs of one process: opening them on the pool's nodes, and the ones in flight.

`Runs` gives each run what it needs of the fleet (`RunServices`: pool,
admission, metrics, timeouts, and its way into and out of the live set) and
knows the runs in flight, so that a drain can wait for them or end them with
a notice. A run's own life is `edge.fleet.run`.
"""

from __future__ import annotations

from collections.abc import Mapping

import trio

from edge.api.request import ChatRequest
from edge.config import TimeoutsConfig
from edge.fleet.admission import Admission
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.fleet.run import Run, RunInfo, RunServices, RunStart
from edge.fleet.turns import Turns
from edge.node.wire import PreparedRunRequest
from edge.observe.metrics import EdgeMetrics
from edge.stream.session import StreamSession


class Runs:
    """Opens runs on the pool's nodes and knows the ones in flight (for drain)."""

    def __init__(
        self,
        pool: NodePool,
        timeouts: TimeoutsConfig,
        metrics: EdgeMetrics,
        admission: Admission,
        turns: Turns | None = None,
    ) -> None:
        self.pool = pool
        self.turns = turns
        self.timeouts = timeouts
        self.metrics = metrics
        self.admission = admission
        # Runs entered whose request is not over yet (maybe a CancelRun still
        # to send).
        self.live: set[Run] = set()
        self._idle = trio.Event()
        # Runs in flight per node, and what wakes those waiting for a node's to end.
        self._on_node: dict[NodeState, int] = {}
        self._ended = trio.Event()
        self._services = RunServices(
            pool, admission, metrics, timeouts, joined=self.joined, left=self.ended
        )

    def open(
        self,
        node: NodeState,
        nursery: trio.Nursery,
        request: ChatRequest,
        payload: PreparedRunRequest,
        session: StreamSession,
        *,
        request_id: str = "",
        keepalive_s: float = 0.0,
        deadline: float | None = None,
        api: str = "chat",
        metadata: Mapping[str, str] | None = None,
        predicted: int = 0,
        timeouts: TimeoutsConfig | None = None,
    ) -> Run:
        """A run of `request` on `node`, whose slot the caller took; enter it to start.
        The slot is the run's from here: given back once its outcome is fixed (its end,
        a start that failed, or `abandon`).

        `payload` is the request's RunRequest, serialized (once for all attempts).

        `nursery` is the request's own: the run's read task lives and ends there.
        `deadline` is the request's total deadline (default: total_s from now).
        Set the run's `on_end` to hear when its outcome is fixed. `api` is the
        request's API (a metrics label); `metadata` goes with the Run call.
        `predicted` is the prefix blocks the pick expected cached on `node` (the
        cache-aware policy's prediction, corrected by the run's usage). `timeouts`:
        the request's (the configuration it arrived under; default: this edge's first).
        """
        run_id = session.settings.run_id
        started_at = trio.current_time()
        info = RunInfo(
            run_id, request.model, node.client.name, request.stream, started_at, request_id, api
        )
        start = RunStart(self._services, node, payload, nursery, metadata, predicted)
        return Run(
            info, session, timeouts or self.timeouts, keepalive_s=keepalive_s, start=start,
            deadline=deadline, turns=self.turns,
        )  # fmt: skip

    def joined(self, run: Run) -> None:
        self.live.add(run)
        node = run.node
        if node is not None:
            self._on_node[node] = self._on_node.get(node, 0) + 1

    def ended(self, run: Run) -> None:
        if run in self.live:
            self.live.discard(run)
            node = run.node
            if node is not None:
                left = self._on_node.pop(node, 1) - 1
                if left:
                    self._on_node[node] = left
        self._ended.set()
        self._ended = trio.Event()
        if not self.live:
            self._idle.set()
            self._idle = trio.Event()

    async def wait_node_idle(self, node: NodeState) -> None:
        """Return once `node` has no run in flight (its read tasks and CancelRuns over) and
        no slot taken. A slot given back without a run (a retry that did not go there)
        is seen at the next end of any run: the caller bounds the wait."""
        while node.in_flight or self._on_node.get(node):
            await self._ended.wait()

    async def wait_idle(self) -> None:
        """Return once no run is in flight."""
        while self.live:
            await self._idle.wait()

    def shut_down(self, notice: str) -> int:
        """Drain deadline: end every run in flight, with a notice. Returns how many."""
        runs = [run for run in self.live if run.accepted]
        for run in runs:
            run.shut_down(notice)
        return len(runs)
