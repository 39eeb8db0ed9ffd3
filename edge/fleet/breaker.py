"""One node's circuit breaker, from its runs: `CircuitBreaker`.

A pure state machine, as the node's health (`edge.fleet.health`) that holds
it: every input carries `now`, and the numbers it runs by (the failures that
open it, the cooldown) come with each call, from the health's policy, which a
reload may change.

`breaker_failures` run failures in a row open it (no new runs); `cooldown_s`
later it is half-open: one probe run may start (`take`); a run that succeeds
closes it, one that fails opens it again. A probe whose verdict never comes
(its caller left before the first event) frees the probe after another
`cooldown_s`; one the node refused (4xx) or was too busy for (429) frees it at
once (neither counts either way). A node that comes back up from down has its
breaker closed and its count reset (`restarted`): its failures were those of
the process that died (its own failures open the breaker again).

Knows nothing of whether the node is reachable: the health combines the two.
"""

from __future__ import annotations

import math
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """The breaker of one node (see the module doc). Methods that change it return
    whether the node may take runs it could not before, or, for `failed`, whether it
    opened."""

    __slots__ = ("_opened_at", "_probe_taken_at", "failures", "state")

    def __init__(self) -> None:
        self.state: BreakerState = "closed"
        # Run failures in a row (any success resets it).
        self.failures = 0
        self._opened_at = -math.inf
        self._probe_taken_at: float | None = None

    def restarted(self) -> None:
        """The node came back up from down: an open or half-open breaker closes, its
        count reset (a closed one keeps its count)."""
        if self.state != "closed":
            self.state = "closed"
            self.failures = 0
            self._probe_taken_at = None

    def succeeded(self) -> bool:
        """A run got its first event (or completed): the count resets, the breaker closes.
        True when it was not closed."""
        self.failures = 0
        if self.state == "closed":
            return False
        self.state = "closed"
        self._probe_taken_at = None
        return True

    def failed(self, now: float, breaker_failures: int) -> bool:
        """A run could not start, broke, or failed before output. True when this opened
        the breaker: a half-open probe failed, or `breaker_failures` in a row."""
        self.failures += 1
        if self.state == "half_open" or (
            self.state == "closed" and self.failures >= breaker_failures
        ):
            self.state = "open"
            self._opened_at = now
            self._probe_taken_at = None
            return True
        return False

    def refused(self) -> bool:
        """A run the node refused or was too busy for: neither a success nor a failure, so
        the count stands. True when that frees a half-open probe."""
        if self.state == "half_open" and self._probe_taken_at is not None:
            self._probe_taken_at = None
            return True
        return False

    def advance(self, now: float, cooldown_s: float) -> bool:
        """Let time pass: an open breaker past its cooldown half-opens, a probe lease that
        ran out frees the probe. True when either happened."""
        if self.state == "open" and now >= self._opened_at + cooldown_s:
            self.state = "half_open"
            self._probe_taken_at = None
            return True
        taken = self._probe_taken_at
        if self.state == "half_open" and taken is not None and now >= taken + cooldown_s:
            self._probe_taken_at = None
            return True
        return False

    def admits(self, now: float, cooldown_s: float) -> bool:
        """Whether the breaker lets a new run through now (not changing anything)."""
        state = self.at(now, cooldown_s)
        if state == "closed":
            return True
        if state == "half_open":
            taken = self._probe_taken_at if self.state == "half_open" else None
            return taken is None or now >= taken + cooldown_s
        return False

    def take(self, now: float, cooldown_s: float) -> None:
        """A run was given to the node: when half-open, that run is its one probe."""
        if self.at(now, cooldown_s) == "half_open":
            self.state = "half_open"
            self._probe_taken_at = now

    def at(self, now: float, cooldown_s: float) -> BreakerState:
        """The state at `now`: an open breaker past its cooldown is half-open."""
        if self.state == "open" and now >= self._opened_at + cooldown_s:
            return "half_open"
        return self.state

    def wake_at(self, cooldown_s: float) -> float:
        """When the breaker changes by itself: its half-opening, its probe lease running
        out (inf: neither is pending)."""
        if self.state == "open":
            return self._opened_at + cooldown_s
        if self.state == "half_open" and self._probe_taken_at is not None:
            return self._probe_taken_at + cooldown_s
        return math.inf
