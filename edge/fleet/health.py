"""One node's health: whether it is reachable, and its circuit breaker.

A pure state machine, with no I/O and no clock of its own: every input
carries `now` (seconds on the pool's clock, trio's in the daemon), so tests
drive it with plain numbers. The pool (`edge.fleet.pool`) feeds it and acts on
what it answers; this module knows nothing of nodes, requests or trio.

Two parts, one state shown (`state`):
- Reachability, from Describe (or Watch) and run starts: `up` or `down`. A
  node that answered before goes down after DOWN_AFTER_FAILURES Describe
  failures in a row (one slow answer from a busy node must not take it out),
  or at once when it refuses a run (`mark_down`). Down, or suspect (one
  failure), it is probed again soon: PROBE_FIRST_S, doubling, capped at
  PROBE_MAX_S and the refresh interval; so a restarted node serves again
  within about a second. Up, it is asked every refresh interval.
- A watched node (Watch) gives the same inputs: each report is a Describe
  answer (`reported`), a broken stream or a failed subscription a failed
  Describe (`watch_failed`), so it is suspect at once and subscribed to again
  on the probes' schedule (`next_check`). Its silence is bounded: a report
  is due within `silence_bound` of the last one (or of the subscription),
  SILENCE_HEARTBEATS heartbeats and at least SILENCE_MIN_S; past it (`silent_at`,
  the deadline the feed waits for a report by) the watch has failed.
- The breaker, from runs (`edge.fleet.breaker`): `breaker_failures` run
  failures in a row open it, `cooldown_s` later one probe run may start. The
  health holds it and its numbers: a run that succeeds on a down node brings
  the node up, and a node that comes back up from down has its breaker closed.

The state shown is `down` when unreachable, else `open`, `half_open` or `up`
(closed breaker). STATE_VALUES gives the number each has on the
`iop_edge_node_state` gauge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from edge.fleet.breaker import CircuitBreaker

NodeStateName = Literal["up", "down", "open", "half_open"]

# The value of each state on the iop_edge_node_state{node} gauge.
STATE_VALUES: dict[NodeStateName, int] = {"down": 0, "up": 1, "half_open": 2, "open": 3}

# Describe failures in a row that take a node that answered before out of routing.
DOWN_AFTER_FAILURES = 2
# Probes of a down (or suspect) node: the first this long after the failure, then doubling.
PROBE_FIRST_S = 0.25
PROBE_MAX_S = 1.0
# A watched node silent for this many of its heartbeats, and at least this long, has failed.
SILENCE_HEARTBEATS = 3
SILENCE_MIN_S = 1.0


def silence_bound(heartbeat_s: float) -> float:
    """How long a watched node with this heartbeat may stay silent."""
    return max(SILENCE_HEARTBEATS * heartbeat_s, SILENCE_MIN_S)


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """The numbers every node's health runs by (`[routing]`, `[server] node_refresh_s`)."""

    breaker_failures: int = 5
    cooldown_s: float = 5.0
    refresh_s: float = 5.0
    probe_first_s: float = PROBE_FIRST_S
    probe_max_s: float = PROBE_MAX_S

    @property
    def probe_cap_s(self) -> float:
        return min(self.probe_max_s, self.refresh_s)


class NodeHealth:
    """Reachability and breaker of one node; every method takes the pool clock's `now`.

    Methods that change the state return whether the node may take runs again
    (came up, breaker closed) or, for `run_failed`, whether the breaker opened,
    so the pool can log and wake whoever waits for a node.
    """

    __slots__ = (
        "_backoff",
        "breaker",
        "describe_failures",
        "last_failed_at",
        "next_check",
        "policy",
        "reason",
        "silent_at",
        "up",
        "up_since",
    )

    def __init__(self, policy: HealthPolicy) -> None:
        self.policy = policy
        self.up = False
        # When the node last came up (a run started before it ran on what went down).
        self.up_since = -math.inf
        self.reason: str | None = "not contacted yet"
        self.describe_failures = 0
        # When the pool should send the next Describe.
        self.next_check = -math.inf
        self._backoff = policy.probe_first_s
        self.breaker = CircuitBreaker()
        # The last failure of any kind (panic routing tries the least recent first).
        self.last_failed_at = -math.inf
        # Watched: when the next report is overdue (inf: no subscription open).
        self.silent_at = math.inf

    # --- reachability ---------------------------------------------------------------

    def describe_ok(self, now: float) -> bool:
        """The node answered Describe. True when it was down and may take runs again."""
        came_up = not self.up
        self.up = True
        if came_up:
            self.up_since = now
            # The failures that opened its breaker were the process that went down: the
            # one that answers now starts with a closed breaker (its own failures reopen it).
            self.breaker.restarted()
        self.reason = None
        self.describe_failures = 0
        self._backoff = self.policy.probe_first_s
        self.next_check = now + self.policy.refresh_s
        return came_up

    def describe_failed(self, now: float, reason: str) -> bool:
        """Describe failed (or timed out). True when this took the node down."""
        self.describe_failures += 1
        self.last_failed_at = now
        self._schedule_probe(now)
        if self.up and self.describe_failures < DOWN_AFTER_FAILURES:
            return False  # suspect: asked again soon, still routed to
        went_down = self.up
        self.up = False
        self.reason = reason
        return went_down

    def mark_down(self, now: float, reason: str) -> bool:
        """The node refused a run: down at once, probed soon. True when it was up."""
        self.last_failed_at = now
        self.reason = reason
        if not self.up:
            return False
        self.up = False
        self._backoff = self.policy.probe_first_s
        self._schedule_probe(now)
        return True

    # --- reachability, watched (Watch) -------------------------------------------------

    def subscribed(self, now: float, heartbeat_s: float) -> None:
        """A Watch subscription was opened, asking for `heartbeat_s`: its first report is
        due within that heartbeat's silence bound."""
        self.silent_at = now + silence_bound(heartbeat_s)

    def reported(self, now: float, heartbeat_s: float) -> bool:
        """A Watch report arrived (the node keeps `heartbeat_s`): a Describe answer, and the
        next report is due within the silence bound. True when the node came up."""
        self.silent_at = now + silence_bound(heartbeat_s)
        return self.describe_ok(now)

    def watch_failed(self, now: float, reason: str) -> bool:
        """The Watch stream broke, stayed silent past its bound, or could not be opened: a
        failed Describe (suspect, then down). True when this took the node down."""
        self.silent_at = math.inf
        return self.describe_failed(now, reason)

    def _schedule_probe(self, now: float) -> None:
        if self.next_check <= now:  # this was the check due: the next one after the backoff
            self.next_check = now + self._backoff
        else:  # a check already planned (the normal refresh): no later than the backoff
            self.next_check = min(self.next_check, now + self._backoff)
        self._backoff = min(self._backoff * 2, self.policy.probe_cap_s)

    # --- runs, and the breaker ---------------------------------------------------------

    def run_succeeded(self, now: float) -> bool:
        """A run on the node got its first event (or completed).

        Closes the breaker (a half-open probe, or any success: the failures are
        no longer in a row), and marks an unreachable node up (a run sent to it
        by panic routing worked): it is asked for its models at once. True when
        the node may take runs again.
        """
        available = self.breaker.succeeded()
        if not self.up:
            self.up = True
            self.up_since = now
            self.reason = None
            self.describe_failures = 0
            self._backoff = self.policy.probe_first_s
            self.next_check = now
            available = True
        return available

    def run_failed(self, now: float) -> bool:
        """A run could not start, broke, or failed before output. True when the breaker opened."""
        self.last_failed_at = now
        return self.breaker.failed(now, self.policy.breaker_failures)

    def run_refused(self, now: float) -> bool:
        """A run the node refused (4xx: the request's fault) or was too busy for (429):
        neither a success nor a failure, so the count stands. A half-open probe is freed
        at once (the node's health is still unknown: the next run probes it) rather than
        held for a cooldown. True when that frees the probe of a reachable node."""
        return self.breaker.refused() and self.up

    def advance(self, now: float) -> bool:
        """Let time pass: an open breaker past its cooldown half-opens, a probe lease that
        ran out frees the probe. True when the node may take a run it could not before."""
        return self.breaker.advance(now, self.policy.cooldown_s) and self.up

    def admits(self, now: float) -> bool:
        """Whether a new run may go to the node now (not changing anything); the run given
        to it is the breaker's to `take`."""
        return self.up and self.breaker.admits(now, self.policy.cooldown_s)

    # --- what the pool shows and when it wakes -------------------------------------------

    def state(self, now: float) -> NodeStateName:
        if not self.up:
            return "down"
        breaker = self.breaker.at(now, self.policy.cooldown_s)
        return "up" if breaker == "closed" else breaker

    def wake_at(self, *, describing: bool) -> float:
        """When the pool has something to do for this node: its next Describe (unless one
        is under way), its breaker's half-opening, its probe lease running out."""
        at = math.inf if describing else self.next_check
        return min(at, self.breaker.wake_at(self.policy.cooldown_s))
