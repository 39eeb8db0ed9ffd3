"""The runs of one process: opening them on the pool's nodes, and the ones in flight.

`RunPlan` is what every run of one request starts from, built once per request and
passed on by failover (each attempt) and migration (each continuation). `Runs`
opens runs from it, gives each what it needs of the fleet (`RunServices`: pool,
admission, metrics, timeouts, and its way into and out of the live set) and
knows the runs in flight, so that a drain can wait for them or end them with
a notice. A run's own life is `edge.fleet.run`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import trio

from edge.api.request import ChatRequest
from edge.config import TimeoutsConfig
from edge.fleet.admission import Admission
from edge.fleet.affinity import SessionKey
from edge.fleet.cacheaware import Route
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool
from edge.fleet.run import Run, RunInfo, RunServices, RunStart
from edge.fleet.tenants import Tenant
from edge.fleet.turns import Turns
from edge.node.wire import PreparedRunRequest
from edge.observe.metrics import EdgeMetrics
from edge.stream.session import StreamSession


@dataclass(frozen=True, slots=True)
class RunPlan:
    """What every run of one request starts from (its attempts and continuations).

    `payload` is the request's RunRequest, serialized once (a continuation sends its
    own, `Runs.open(payload=...)`). `deadline` is the request's total deadline (trio
    clock), across attempts. `api` is the request's API (a metrics label);
    `metadata` goes with each Run call (the trace context). `affinity_key` and
    `route` are the request's session and prefix for picking nodes. `timeouts` are
    the request's (the configuration it arrived under; None: the edge's first).
    `tenant` and `tier` are whose the request is and the service tier it runs on: its
    queue and band whenever a run of it waits for a slot (`Admission.acquire`).
    """

    request: ChatRequest
    payload: PreparedRunRequest
    deadline: float
    request_id: str = ""
    api: str = "chat"
    keepalive_s: float = 0.0
    metadata: Mapping[str, str] | None = None
    affinity_key: SessionKey | None = None
    route: Route | None = None
    timeouts: TimeoutsConfig | None = None
    tenant: Tenant | None = None
    tier: str = "default"

    @property
    def predicted(self) -> int:
        """The prefix blocks the pick expected cached on the node it chose."""
        return self.route.predicted if self.route is not None else 0


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
            pool, admission, metrics, timeouts, turns, joined=self.joined, left=self.ended
        )

    def open(
        self,
        node: NodeState,
        nursery: trio.Nursery,
        plan: RunPlan,
        session: StreamSession,
        *,
        payload: PreparedRunRequest | None = None,
    ) -> Run:
        """A run of `plan`'s request on `node`, whose slot the caller took; enter it to
        start. The slot is the run's from here: given back once its outcome is fixed
        (its end, a start that failed, or `abandon`).

        `nursery` is the request's own: the run's read task lives and ends there.
        `payload`: what this run sends instead of the plan's (a continuation's). Set
        """
        run_id = session.settings.run_id
        started_at = trio.current_time()
        request = plan.request
        info = RunInfo(
            run_id, request.model, node.client.name, request.stream, started_at,
            plan.request_id, plan.api,
        )  # fmt: skip
        start = RunStart(
            self._services, node, payload or plan.payload, nursery, plan.metadata,
            plan.predicted,
        )  # fmt: skip
        return Run(
            info, session, start, plan.timeouts or self.timeouts, deadline=plan.deadline,
            keepalive_s=plan.keepalive_s,
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
            run.reader.shut_down(notice)
        return len(runs)
