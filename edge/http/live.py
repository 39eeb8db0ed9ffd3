"""The configuration a request runs on: one immutable snapshot, swapped whole by a reload.

A `Snapshot` is one configuration as the edge applies it (`config`: its settings
bound at start keep their running values, `edge.config.reload`) and what is
built from it once for every request that arrives under it: the API keys,
the limiter of those with limits, failover (the routing and the run
deadlines a request keeps), the CORS policy. `Snapshots` holds the current one; a reload
(`edge.process.reload`) builds the next one whole, checked, and swaps it in
in one assignment, so a request sees one configuration or the other, never
a mix.

A request takes the current snapshot once, when it arrives (the app's
connection sets `CURRENT` for the request's task, `edge.http.app`), and keeps
it to its end: a stream in flight finishes on the configuration it started
with, whatever reloads come meanwhile. What is shared by every request (the
pool's nodes, the admission queue, the log level) is changed in place by the
reload instead.

A new setting is live when it is read from the request's snapshot
(`Snapshots.request().config`) instead of being kept from the start; an
object built from settings (a compiled pattern, a policy) becomes a field
here, built with the others (`edge.process.reload.build_snapshot`).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from edge.config import Config
from edge.fleet.failover import Failover
from edge.http.cors import Cors
from edge.limits.limiter import KeyRing, Limiter


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One configuration and what requests use of it, built once."""

    config: Config
    # The accepted API keys (`[[keys]]`, `[server] api_keys`).
    keys: KeyRing
    # The limiter of the keys with limits (None: no key has one).
    limiter: Limiter | None
    # Attempts, retries and migrations under this configuration's routing and deadlines.
    failover: Failover
    # The origins browsers may call from (`[server] cors_allow_origins`).
    cors: Cors
    # The file's digest (`edge.config.parse.config_digest`) and when it was loaded (Unix time).
    digest: str = ""
    loaded_at: float = 0.0


# The snapshot of the request the current task serves (None: not in a request).
CURRENT: ContextVar[Snapshot | None] = ContextVar("iop_config_snapshot", default=None)


class Snapshots:
    """The current snapshot of one edge process."""

    def __init__(self, first: Snapshot) -> None:
        self.current = first

    def swap(self, new: Snapshot) -> Snapshot:
        """`new` for every request that arrives from now on; returns the one it replaces."""
        old, self.current = self.current, new
        return old

    def request(self) -> Snapshot:
        """The snapshot of the request this task serves, taken when it arrived; outside a
        request, the current one."""
        taken = CURRENT.get()
        return self.current if taken is None else taken
