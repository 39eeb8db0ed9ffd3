"""The nodes an edge routes to, and which models each serves.

The pool learns each node's models from its Describe RPC, refreshed in the
background, and picks a node for a model: the healthy node serving it with
the fewest runs in flight. It raises the edge's errors: NotFoundError for a
model no node serves, NodeUnavailableError when the nodes that could serve it
are down.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import trio
from loguru import logger

from edge.errors import NodeUnavailableError, NotFoundError, RequestError
from edge.node.client import NodeClient, NodeDescription

REFRESH_INTERVAL_S = 5.0
# A node that answered before is marked down after this many Describe failures
# in a row: one slow answer from a busy node must not take it out of routing.
# A node that refuses a run (NodeUnavailableError) is marked down at once.
DOWN_AFTER_FAILURES = 2


@dataclass(slots=True)
class NodeState:
    client: NodeClient
    healthy: bool = False
    models: tuple[str, ...] = ()
    # The models it gives token logprobs for (a node older than the field: none).
    logprobs_models: frozenset[str] = frozenset()
    error: str | None = "not contacted yet"
    in_flight: int = 0
    failures: int = 0
    description: NodeDescription | None = field(default=None, repr=False)
    # Runs in flight allowed at once (inf: unlimited).
    max_runs: float = math.inf

    def has_slot(self) -> bool:
        return self.in_flight < self.max_runs


class NodePool:
    def __init__(self, clients: list[NodeClient]) -> None:
        self.nodes = [NodeState(c) for c in clients]
        self._refreshed = trio.Event()
        # Called when a node may take runs again (set by the admission queue).
        self.on_available: Callable[[], None] | None = None

    async def refresh(self) -> None:
        """Ask every node for its models, concurrently; mark each healthy or not."""
        async with trio.open_nursery() as nursery:
            for state in self.nodes:
                nursery.start_soon(self._refresh_one, state)
        self._refreshed.set()

    async def _refresh_one(self, state: NodeState) -> None:
        try:
            description = await state.client.describe()
        except Exception as exc:  # EdgeError, TooSlowError, or a bug: never kill the pool
            state.failures += 1
            if state.healthy and state.failures < DOWN_AFTER_FAILURES:
                return
            self.mark_down(state, str(exc) or type(exc).__name__)
            return
        state.failures = 0
        if not state.healthy:
            logger.info(
                "node {} is up, models: {}", state.client.name, ", ".join(description.models)
            )
        state.healthy = True
        state.error = None
        state.models = description.models
        state.logprobs_models = description.logprobs_models
        state.description = description

    def mark_down(self, state: NodeState, reason: str) -> None:
        """Take a node out of routing until its Describe answers again."""
        if state.healthy:
            logger.warning("node {} is down: {}", state.client.name, reason)
        state.healthy = False
        state.error = reason

    async def run_refresh(self, interval: float = REFRESH_INTERVAL_S) -> None:
        """Refresh forever (in the daemon's nursery)."""
        while True:
            await self.refresh()
            await trio.sleep(interval)

    def run_succeeded(self, state: NodeState) -> None:
        """A run on `state` went through (health feedback)."""

    def run_failed(self, state: NodeState, reason: str) -> None:
        """A run on `state` failed on the node's side (health feedback)."""

    def pick(
        self,
        model: str,
        *,
        logprobs: bool = False,
        exclude: Collection[NodeState] = (),
        affinity_key: str | None = None,
    ) -> NodeState | None:
        """The healthy node serving `model` with the fewest runs in flight.

        Nodes in `exclude` are skipped; None when nodes could serve it but none
        has a free slot now.

        With `logprobs`, only a node that gives logprobs for the model: when
        every node known to serve it says it cannot, the request is the
        caller's to change (400, `param: "logprobs"`), before any run starts.
        """
        best: NodeState | None = None
        known = capable = full = False
        for state in self.nodes:
            if model in state.models:
                known = True
                if logprobs and model not in state.logprobs_models:
                    continue
                capable = True
                if not state.healthy or any(state is e for e in exclude):
                    continue
                if not state.has_slot():
                    full = True
                elif best is None or state.in_flight < best.in_flight:
                    best = state
        if best is not None:
            return best
        if full:
            return None
        if known and not capable:
            raise RequestError(
                f"The model {model!r} is served by nodes that do not give logprobs;"
                " send the request without 'logprobs' and 'top_logprobs'.",
                param="logprobs",
            )
        if known or any(not s.healthy for s in self.nodes):
            raise NodeUnavailableError(f"no node is available for model {model!r}; retry later")
        raise NotFoundError(
            f"The model {model!r} does not exist or is not served here.",
            param="model",
            code="model_not_found",
        )

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for state in self.nodes:
            for model in state.models:
                seen.setdefault(model, None)
        return list(seen)

    @property
    def ready(self) -> bool:
        return any(s.healthy for s in self.nodes)

    def status(self) -> list[dict[str, object]]:
        return [
            {
                "name": s.client.name,
                "address": s.client.address,
                "healthy": s.healthy,
                "models": list(s.models),
                "in_flight": s.in_flight,
                **({"error": s.error} if s.error else {}),
            }
            for s in self.nodes
        ]

    async def aclose(self) -> None:
        for state in self.nodes:
            await state.client.aclose()
