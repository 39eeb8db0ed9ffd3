"""The counters of one edge's workers: fixed slots in a file they all map.

Without Redis, the workers of one edge (in the directory their supervisor
made for that edge run) share one file of fixed slots, one slot per limited key,
in the order of the sorted key names (the workers read the same config, so
they agree on it). A slot holds the key's window (start, requests, tokens)
and up to `edge.limits.slotfile.PID_ENTRIES` (pid, streams, expiry) entries:
each worker counts the streams it holds under its own pid, until the entry's
expiry. A worker
renews its entries every `lease_renew_s` while it holds streams (`renew`
sets each to the streams its live requests hold, another `lease_ms` ahead),
so a count that is wrong (a release that never ran) or held by a worker that
hangs counts for one lease at most; a worker that died (and was restarted
under another pid) leaves streams no live process holds, given back at once
when the key reaches `max_streams` and the pid is gone.

Each operation takes the slot's byte range with `fcntl.lockf` (between
processes; held for a few microseconds, no await inside, so tasks of one
process never interleave in it), reads, runs `edge.limits.window`, writes.
The clock is CLOCK_MONOTONIC, one for every process of the machine. The
file itself (its name, layout, mapping and locks) is `edge.limits.slotfile`'s;
this module owns what the counts mean.

A reload that changes the set of limited keys (`rekey`) moves every worker to
the file of the new names, the counts of the keys in both copied over.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from edge.limits.base import monotonic_ms
from edge.limits.slotfile import Entry, SlotFile
from edge.limits.window import Decision, Limits, Window, add_tokens, admit, refund

__all__ = ["DEFAULT_LEASE_MS", "SharedFileStore"]

DEFAULT_LEASE_MS = 10_000


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _held(entries: list[Entry], now: int) -> int:
    """Streams held: those of entries whose lease has not run out."""
    return sum(streams for _, streams, expires in entries if streams and expires > now)


class SharedFileStore:
    """Exact limits across the processes that open the same file (see the module doc)."""

    kind = "shared"

    def __init__(
        self,
        directory: Path,
        keys: list[tuple[str, Limits]],
        *,
        clock: Callable[[], int] = monotonic_ms,
        lease_ms: int = DEFAULT_LEASE_MS,
    ) -> None:
        self._clock = clock
        self._lease_ms = lease_ms
        self._directory = directory
        self._file = SlotFile(directory, sorted(n for n, _ in keys))

    @property
    def path(self) -> Path:
        """The file the counters are in now."""
        return self._file.path

    def rekey(self, keys: list[tuple[str, Limits]]) -> None:
        """The limited keys changed (a reload): the file of the new names, every worker's
        the same (the first to switch makes it, with the counts of the keys in both). A
        worker that switches later counts in the old file meanwhile: each renewal puts
        its streams right in the new one (within `lease_renew_s`)."""
        names = sorted(n for n, _ in keys)
        if names == self._file.names:
            return
        before = self._file
        self._file = SlotFile(self._directory, names, before)
        before.close()

    def _reclaim(self, offset: int, entries: list[Entry]) -> list[Entry]:
        """Give back the streams of processes that are gone."""
        me = os.getpid()
        for i, (pid, streams, _) in enumerate(entries):
            if streams and pid != me and not _alive(pid):
                self._file.put_entry(offset, i, 0, 0, 0)
        return self._file.entries(offset)

    def _own_entry(self, entries: list[Entry], now: int) -> int | None:
        """This process's entry, else a free one (no streams, or its lease ran out)."""
        me = os.getpid()
        for i, (pid, _, _) in enumerate(entries):
            if pid == me:
                return i
        for i, (_, streams, expires) in enumerate(entries):
            if not streams or expires <= now:
                return i
        return None

    async def admit(self, key: str, limits: Limits, lease: str) -> Decision:
        with self._file.slot(key) as offset:
            now = self._clock()
            if offset < 0:
                return admit(Window(), 0, limits, now)
            window = self._file.window(offset)
            entries = self._file.entries(offset)
            held = _held(entries, now)
            counted = limits.max_streams is not None
            if counted and limits.max_streams is not None and held >= limits.max_streams:
                entries = self._reclaim(offset, entries)
                held = _held(entries, now)
            own = self._own_entry(entries, now) if counted else None
            if counted and own is None:
                entries = self._reclaim(offset, entries)
                own = self._own_entry(entries, now)
            if counted and own is None:  # every entry held by a live process: full
                held = max(held, limits.max_streams or 0)
            decision = admit(window, held, limits, now)
            self._file.put_window(offset, window)
            if decision.admitted and own is not None:
                pid, streams, expires = entries[own]
                mine = streams if pid == os.getpid() and expires > now else 0
                self._file.put_entry(offset, own, os.getpid(), mine + 1, now + self._lease_ms)
            return decision

    def _release(self, offset: int) -> None:
        me = os.getpid()
        for i, (pid, streams, expires) in enumerate(self._file.entries(offset)):
            if pid == me and streams > 0:
                self._file.put_entry(offset, i, me, streams - 1, expires)
                return

    async def release(self, key: str, lease: str) -> None:
        with self._file.slot(key) as offset:
            if offset >= 0:
                self._release(offset)

    async def refund(self, key: str, lease: str) -> None:
        with self._file.slot(key) as offset:
            if offset < 0:
                return
            window = self._file.window(offset)
            refund(window, self._clock())
            self._file.put_window(offset, window)
            self._release(offset)

    async def renew(self, leases: Mapping[str, Collection[str]]) -> None:
        me = os.getpid()
        for key, held in leases.items():
            if not self._file.has(key):
                continue
            with self._file.slot(key) as offset:
                now = self._clock()
                entries = self._file.entries(offset)
                own = next((i for i, (pid, _, _) in enumerate(entries) if pid == me), None)
                if own is None and held:
                    own = self._own_entry(entries, now)
                if own is not None:
                    self._file.put_entry(offset, own, me, len(held), now + self._lease_ms)

    async def add_tokens(self, key: str, tokens: int) -> None:
        with self._file.slot(key) as offset:
            if offset < 0:
                return
            window = self._file.window(offset)
            add_tokens(window, tokens, self._clock())
            self._file.put_window(offset, window)

    async def aclose(self) -> None:
        self._file.close()
