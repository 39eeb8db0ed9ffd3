"""The fleet as one object: what a request needs to get a node and run there.

`Fleet` holds the pool of nodes, the admission queue, the live runs, failover
and the scheduler's turns, built once by the process that serves (the daemon)
and handed to the HTTP handler, which uses them and builds none of them. A
holder only: it builds nothing and decides nothing (each part's module does).
"""

from __future__ import annotations

from dataclasses import dataclass

from edge.fleet.admission import Admission
from edge.fleet.failover import Failover
from edge.fleet.pool import NodePool
from edge.fleet.runs import Runs
from edge.fleet.turns import Turns


@dataclass(frozen=True, slots=True)
class Fleet:
    """The nodes, and the one way requests become runs on them."""

    pool: NodePool
    # The heavy steps of a request (its start, each batch of its answer, its end) take
    # turns with every other request's.
    turns: Turns
    # Node slots, the queue for them, and the memory budget.
    admission: Admission
    # The runs in flight (drain waits for them, then ends what is left).
    runs: Runs
    # Attempts on other nodes when one cannot start.
    failover: Failover
