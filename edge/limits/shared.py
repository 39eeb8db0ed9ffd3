"""The counters of one edge's workers: fixed slots in a file they all map.

Without Redis, the workers of one edge (in the directory their supervisor
made for that edge run) share one file of fixed slots, one slot per limited key,
in the order of the sorted key names (the workers read the same config, so
they agree on it). A slot holds the key's window (start, requests, tokens)
and up to `PID_ENTRIES` (pid, streams, expiry) entries: each worker counts
the streams it holds under its own pid, until the entry's expiry. A worker
renews its entries every `lease_renew_s` while it holds streams (`renew`
sets each to the streams its live requests hold, another `lease_ms` ahead),
so a count that is wrong (a release that never ran) or held by a worker that
hangs counts for one lease at most; a worker that died (and was restarted
under another pid) leaves streams no live process holds, given back at once
when the key reaches `max_streams` and the pid is gone.

Each operation takes the slot's byte range with `fcntl.lockf` (between
processes; held for a few microseconds, no await inside, so tasks of one
process never interleave in it), reads, runs `edge.limits.window`, writes.
The clock is CLOCK_MONOTONIC, one for every process of the machine.

A reload that changes the set of limited keys (`rekey`) moves every worker to
the file of the new names, the counts of the keys in both copied over.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path

from edge.limits.base import monotonic_ms
from edge.limits.window import Decision, Limits, Window, add_tokens, admit, refund

PID_ENTRIES = 64
_WINDOW = struct.Struct("<qqq")
# pid, streams, expiry (ms on the store's clock)
_ENTRY = struct.Struct("<qqq")
_Entry = tuple[int, int, int]
# The layout's version, in the file's name: a file of another layout is never mapped.
_LAYOUT = "2"
DEFAULT_LEASE_MS = 10_000
SLOT_BYTES = _WINDOW.size + PID_ENTRIES * _ENTRY.size


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        self._slots, self.path, self._map, self._fd = self._open(sorted(n for n, _ in keys))

    def _open(
        self, names: list[str], before: tuple[dict[str, int], mmap.mmap, int] | None = None
    ) -> tuple[dict[str, int], Path, mmap.mmap, int]:
        """The file of `names` (slots, path, map, descriptor), made if no worker made it
        yet; then, with `before` (the slots, map and descriptor of the file used so far),
        the slots of the keys in both are copied into it (`rekey`)."""
        slots = {name: i for i, name in enumerate(names)}
        # Another config (another edge in the same directory) gets another file.
        digest = hashlib.sha256("\n".join([_LAYOUT, *names]).encode()).hexdigest()[:16]
        path = self._directory / f"limits-{digest}.slots"
        size = max(1, len(names)) * SLOT_BYTES
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                made = os.fstat(fd).st_size < size
                if made:
                    os.ftruncate(fd, size)  # new bytes read as zeros: empty slots
                mapped = mmap.mmap(fd, size)
                if made and before is not None:
                    _copy_slots(before, slots, mapped)
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        return slots, path, mapped, fd

    def rekey(self, keys: list[tuple[str, Limits]]) -> None:
        """The limited keys changed (a reload): the file of the new names, every worker's
        the same (the first to switch makes it, with the counts of the keys in both). A
        worker that switches later counts in the old file meanwhile: each renewal puts
        its streams right in the new one (within `lease_renew_s`)."""
        names = sorted(n for n, _ in keys)
        if names == sorted(self._slots):
            return
        before = (self._slots, self._map, self._fd)
        self._slots, self.path, self._map, self._fd = self._open(names, before)
        before[1].close()
        os.close(before[2])

    @contextlib.contextmanager
    def _slot(self, key: str) -> Iterator[int]:
        """The offset of `key`'s slot, its byte range locked against the other workers.
        A key with no slot (it left the limited keys in a reload while one of its
        requests was under way) gets -1: it is counted nowhere."""
        if key not in self._slots:
            yield -1
            return
        offset = self._slots[key] * SLOT_BYTES
        fcntl.lockf(self._fd, fcntl.LOCK_EX, SLOT_BYTES, offset)
        try:
            yield offset
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, SLOT_BYTES, offset)

    def _window(self, offset: int) -> Window:
        start, requests, tokens = _WINDOW.unpack_from(self._map, offset)
        # A zeroed slot (start 0) is a window that ended long ago: roll() starts one.
        return Window(start if start else -1, requests, tokens)

    def _put_window(self, offset: int, window: Window) -> None:
        _WINDOW.pack_into(self._map, offset, window.start_ms, window.requests, window.tokens)

    def _entries(self, offset: int) -> list[_Entry]:
        base = offset + _WINDOW.size
        return [_ENTRY.unpack_from(self._map, base + i * _ENTRY.size) for i in range(PID_ENTRIES)]

    def _put_entry(self, offset: int, i: int, pid: int, streams: int, expires: int) -> None:
        _ENTRY.pack_into(self._map, offset + _WINDOW.size + i * _ENTRY.size, pid, streams, expires)

    @staticmethod
    def _held(entries: list[_Entry], now: int) -> int:
        """Streams held: those of entries whose lease has not run out."""
        return sum(streams for _, streams, expires in entries if streams and expires > now)

    def _reclaim(self, offset: int, entries: list[_Entry]) -> list[_Entry]:
        """Give back the streams of processes that are gone."""
        me = os.getpid()
        for i, (pid, streams, _) in enumerate(entries):
            if streams and pid != me and not _alive(pid):
                self._put_entry(offset, i, 0, 0, 0)
        return self._entries(offset)

    def _own_entry(self, entries: list[_Entry], now: int) -> int | None:
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
        with self._slot(key) as offset:
            now = self._clock()
            if offset < 0:
                return admit(Window(), 0, limits, now)
            window = self._window(offset)
            entries = self._entries(offset)
            held = self._held(entries, now)
            counted = limits.max_streams is not None
            if counted and limits.max_streams is not None and held >= limits.max_streams:
                entries = self._reclaim(offset, entries)
                held = self._held(entries, now)
            own = self._own_entry(entries, now) if counted else None
            if counted and own is None:
                entries = self._reclaim(offset, entries)
                own = self._own_entry(entries, now)
            if counted and own is None:  # every entry held by a live process: full
                held = max(held, limits.max_streams or 0)
            decision = admit(window, held, limits, now)
            self._put_window(offset, window)
            if decision.admitted and own is not None:
                pid, streams, expires = entries[own]
                mine = streams if pid == os.getpid() and expires > now else 0
                self._put_entry(offset, own, os.getpid(), mine + 1, now + self._lease_ms)
            return decision

    def _release(self, offset: int) -> None:
        me = os.getpid()
        for i, (pid, streams, expires) in enumerate(self._entries(offset)):
            if pid == me and streams > 0:
                self._put_entry(offset, i, me, streams - 1, expires)
                return

    async def release(self, key: str, lease: str) -> None:
        with self._slot(key) as offset:
            if offset >= 0:
                self._release(offset)

    async def refund(self, key: str, lease: str) -> None:
        with self._slot(key) as offset:
            if offset < 0:
                return
            window = self._window(offset)
            refund(window, self._clock())
            self._put_window(offset, window)
            self._release(offset)

    async def renew(self, leases: Mapping[str, Collection[str]]) -> None:
        me = os.getpid()
        for key, held in leases.items():
            if key not in self._slots:
                continue
            with self._slot(key) as offset:
                now = self._clock()
                entries = self._entries(offset)
                own = next((i for i, (pid, _, _) in enumerate(entries) if pid == me), None)
                if own is None and held:
                    own = self._own_entry(entries, now)
                if own is not None:
                    self._put_entry(offset, own, me, len(held), now + self._lease_ms)

    async def add_tokens(self, key: str, tokens: int) -> None:
        with self._slot(key) as offset:
            if offset < 0:
                return
            window = self._window(offset)
            add_tokens(window, tokens, self._clock())
            self._put_window(offset, window)

    async def aclose(self) -> None:
        self._map.close()
        os.close(self._fd)


def _copy_slots(
    before: tuple[dict[str, int], mmap.mmap, int], slots: dict[str, int], into: mmap.mmap
) -> None:
    """The slots of the keys both files have, from the old file into a new one (each old
    slot's byte range locked while it is read)."""
    old_slots, old_map, old_fd = before
    for name, index in slots.items():
        old = old_slots.get(name)
        if old is None:
            continue
        offset = old * SLOT_BYTES
        fcntl.lockf(old_fd, fcntl.LOCK_EX, SLOT_BYTES, offset)
        try:
            into[index * SLOT_BYTES : (index + 1) * SLOT_BYTES] = old_map[
                offset : offset + SLOT_BYTES
            ]
        finally:
            fcntl.lockf(old_fd, fcntl.LOCK_UN, SLOT_BYTES, offset)
