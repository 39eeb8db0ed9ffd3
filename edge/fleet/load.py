"""How loaded a node is, for the pick of a node per run: the node's own numbers where it
reports them (Watch), else this process's runs on it.

A watched node reports its whole load (`NodeLoad`: every edge's runs, its
model server's queue and KV cache), so every edge process ranks it the same.
Between two reports, what this process changed on it since the last one is
added to its numbers: the runs it started there, less those of its runs that
ended (its runs in flight now, less those at the report). The next report
counts them itself, and the count starts again from there. Runs that ended
count as much as runs that started: a stream of short runs, each over before
the next starts, leaves the node's number as reported, not one higher per run.

`rank` is a node's place, lower first, compared in order:
1. the runs waiting for a place on the node (`waiting_runs`, with the runs
   started since the report that pass its `max_runs`);
2. the part of its KV cache in use (runs started, or ended, since the report
   are taken to use what its runs in flight use on average), where every node
   compared says it (`comparable`): a node that does not (llama.cpp exposes no
   KV figure) is unknown there, neither empty nor full, so among such nodes
   this step compares nothing;
3. its runs in flight over its cap (the node's `max_runs`, else the edge's
   `[[nodes]] max_runs`; with neither, the number itself).
A node that reports no queue counts 0 there. A node without
reports (polled with Describe, or between two subscriptions) is ranked by
this process's runs in flight on it over its cap.

Pure: numbers in, a tuple out; no I/O, no clock. The pool calls `rank` for
each candidate of each pick: a few arithmetic steps and one tuple.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edge.node.describe import NodeDescription

# (waiting runs, KV cache use or None where the node does not say it, runs over the cap)
Rank = tuple[float, float | None, float]


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """What a node last reported of its load (a Watch report)."""

    active: int
    waiting: int = 0
    # The runs it takes at once (0: no cap it knows of).
    max_runs: int = 0
    # The part of its KV cache in use, 0 to 1 (None: it does not say).
    kv_usage: float | None = None

    @classmethod
    def of(cls, description: NodeDescription) -> NodeLoad:
        return cls(
            active=description.active_runs,
            waiting=description.waiting_runs or 0,
            max_runs=description.max_runs,
            kv_usage=description.kv_cache_usage,
        )


def rank(load: NodeLoad | None, in_flight: int, at_report: int, cap: float) -> Rank:
    """The node's rank for a new run (lower: lighter). `load`: its last report (None:
    none); `in_flight`: this process's runs on it now, `at_report` when that report
    came; `cap`: the edge's own bound on them (inf: none)."""
    if load is None:
        return (0.0, None, in_flight / cap if cap != math.inf else float(in_flight))
    since = in_flight - at_report
    active = max(0, load.active + since)
    waiting = load.waiting
    if load.max_runs and active > load.max_runs:
        waiting += active - load.max_runs
        active = load.max_runs
    kv = load.kv_usage
    if kv is not None and since and load.active:
        kv = max(0.0, kv + kv * since / load.active)
    limit = load.max_runs or cap
    return (float(waiting), kv, active / limit if limit != math.inf else float(active))


def comparable(ranks: list[Rank]) -> list[Rank]:
    """`ranks` as they compare with each other: the KV cache's use counts only when every
    one says it (one that does not is unknown, and ranks the others by the rest)."""
    if all(r[1] is not None for r in ranks):
        return ranks
    return [(r[0], None, r[2]) for r in ranks]


def runs(load: NodeLoad | None, in_flight: int, at_report: int) -> int:
    """The node's runs, as one number (the affinity policy's load bound): what it
    reported (in flight and waiting) with this process's change since, else
    `in_flight`."""
    if load is None:
        return in_flight
    return max(0, load.active + load.waiting + in_flight - at_report)
