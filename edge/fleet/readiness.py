"""What the edge shows of its nodes: the `/readyz` report and the node gauges' values.

`report` is `/readyz`'s answer: ready when some node may take runs (up, or
its breaker half-open) and the edge is not draining, with every node's
state, models, runs in flight and cap, its load as it reports it, and its
cache under the cache-aware policy; and the admission queue by service tier.
The HTTP endpoint (`edge.http.app`) only sends it; the node gauges
(`edge.process.nodeset`) read `state_value` and `load_values`.

Reads the pool (`edge.fleet.pool`); changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edge.fleet.health import STATE_VALUES
from edge.fleet.load import NodeLoad
from edge.fleet.nodestate import NodeState
from edge.fleet.pool import NodePool


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether the edge takes requests (`/readyz` answers 200, else 503), and the body."""

    ready: bool
    body: dict[str, object]


def report(pool: NodePool, *, draining: bool, queue: dict[str, object] | None = None) -> Readiness:
    """The `/readyz` answer: why not ready, when not (draining first). `queue`: the
    admission queue's policy and requests waiting by service tier (`Admission.report`)."""
    is_ready = ready(pool) and not draining
    body: dict[str, object] = {
        "status": "ready" if is_ready else "not ready",
        "nodes": status(pool),
    }
    if queue is not None:
        body["queue"] = queue
    if draining:
        body["reason"] = "draining"
    elif not is_ready:
        reachable = any(node.healthy for node in pool.nodes)
        body["reason"] = (
            "every reachable node's circuit breaker is open"
            if reachable
            else "no node answers its Describe RPC"
        )
    return Readiness(is_ready, body)


def ready(pool: NodePool) -> bool:
    """Whether some node may take runs: up, or its breaker half-open."""
    return any(pool.state_of(s) in ("up", "half_open") for s in pool.nodes)


def status(pool: NodePool) -> list[dict[str, object]]:
    """Every node as `/readyz` lists it."""
    cache_aware = pool.picker.cache_aware
    return [
        {
            "name": s.client.name,
            "address": s.client.address,
            "state": pool.state_of(s),
            "healthy": s.healthy,
            "models": list(s.models),
            "in_flight": s.in_flight,
            "max_runs": None if math.isinf(s.max_runs) else int(s.max_runs),
            "failed_runs_in_a_row": s.health.breaker.failures,
            "watched": not s.polled,
            **({"load": _load_status(s.load)} if s.load is not None else {}),
            **({"cache": _cache_status(s, pool.picker.dispatches)} if cache_aware else {}),
            **({"error": s.error} if s.error else {}),
        }
        for s in pool.nodes
    ]


def state_value(pool: NodePool, state: NodeState) -> float:
    """The node's state as the iop_edge_node_state gauge shows it."""
    return STATE_VALUES[pool.state_of(state)]


def load_values(state: NodeState) -> tuple[float, float, float | None, bool]:
    """What the node last reported of its load, for the gauges: (waiting runs, active
    runs, KV cache usage; 0 each without a report, the KV usage None where the node
    does not say it) and whether it is watched."""
    reported = state.load
    if reported is None:
        return 0.0, 0.0, None, not state.polled
    return reported.waiting, reported.active, reported.kv_usage, not state.polled


def _cache_status(state: NodeState, tick: int) -> dict[str, object]:
    """The node's cache as the cache-aware policy sees it at dispatch `tick`, in blocks of
    BLOCK_TOKENS: its capacity, what its index holds, and its live demand (over its
    capacity, the node evicts prefixes still in use, and takes no new one)."""
    cache = state.cache
    return {
        "index": "exact" if cache.exact else "approximate",
        "capacity_blocks": cache.capacity,
        "held_blocks": len(cache),
        "live_blocks": cache.live(tick),
    }


def _load_status(reported: NodeLoad) -> dict[str, object]:
    return {
        "active_runs": reported.active,
        "waiting_runs": reported.waiting,
        # null: the node does not say (llama.cpp), which is not an empty cache
        "kv_cache_usage": None if reported.kv_usage is None else round(reported.kv_usage, 4),
    }
