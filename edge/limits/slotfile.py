"""The file of fixed slots one edge's workers map: its name, its layout, its locks.

This module owns how `edge.limits.shared`'s counters lie on disk: one slot
per limited key, in the order of the sorted key names; in each slot the key's
window (start, requests, tokens) and `PID_ENTRIES` (pid, streams, expiry)
entries. The file is named by the layout's version and the key names, so a
file of another layout, or of another edge's keys, is never mapped. A slot's
byte range is locked with `fcntl.lockf` while it is read and written.

It does not know what the counts mean: admitting, releasing and leases are
`edge.limits.shared`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from edge.limits.window import Window

__all__ = ["PID_ENTRIES", "SLOT_BYTES", "Entry", "SlotFile"]

PID_ENTRIES = 64
_WINDOW = struct.Struct("<qqq")
# pid, streams, expiry (ms on the store's clock)
_ENTRY = struct.Struct("<qqq")
Entry = tuple[int, int, int]
# The layout's version, in the file's name: a file of another layout is never mapped.
_LAYOUT = "2"
SLOT_BYTES = _WINDOW.size + PID_ENTRIES * _ENTRY.size


class SlotFile:
    """The mapped file of `names`' slots, made if no worker made it yet.

    With `before` (the file used so far), a file this call makes gets the
    slots of the keys both files have copied into it.
    """

    __slots__ = ("_fd", "_map", "_slots", "path")

    def __init__(self, directory: Path, names: list[str], before: SlotFile | None = None) -> None:
        self._slots = {name: i for i, name in enumerate(names)}
        # Another config (another edge in the same directory) gets another file.
        digest = hashlib.sha256("\n".join([_LAYOUT, *names]).encode()).hexdigest()[:16]
        self.path = directory / f"limits-{digest}.slots"
        size = max(1, len(names)) * SLOT_BYTES
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                made = os.fstat(fd).st_size < size
                if made:
                    os.ftruncate(fd, size)  # new bytes read as zeros: empty slots
                self._map = mmap.mmap(fd, size)
                if made and before is not None:
                    before._copy_into(self)
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @property
    def names(self) -> list[str]:
        """The keys with a slot, sorted."""
        return sorted(self._slots)

    def has(self, key: str) -> bool:
        return key in self._slots

    @contextlib.contextmanager
    def slot(self, key: str) -> Iterator[int]:
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

    def window(self, offset: int) -> Window:
        start, requests, tokens = _WINDOW.unpack_from(self._map, offset)
        # A zeroed slot (start 0) is a window that ended long ago: roll() starts one.
        return Window(start if start else -1, requests, tokens)

    def put_window(self, offset: int, window: Window) -> None:
        _WINDOW.pack_into(self._map, offset, window.start_ms, window.requests, window.tokens)

    def entries(self, offset: int) -> list[Entry]:
        base = offset + _WINDOW.size
        return [_ENTRY.unpack_from(self._map, base + i * _ENTRY.size) for i in range(PID_ENTRIES)]

    def put_entry(self, offset: int, i: int, pid: int, streams: int, expires: int) -> None:
        _ENTRY.pack_into(self._map, offset + _WINDOW.size + i * _ENTRY.size, pid, streams, expires)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    def _copy_into(self, new: SlotFile) -> None:
        """The slots of the keys both files have, from this file into `new` (each old
        slot's byte range locked while it is read)."""
        for name, index in new._slots.items():
            old = self._slots.get(name)
            if old is None:
                continue
            offset = old * SLOT_BYTES
            fcntl.lockf(self._fd, fcntl.LOCK_EX, SLOT_BYTES, offset)
            try:
                new._map[index * SLOT_BYTES : (index + 1) * SLOT_BYTES] = self._map[
                    offset : offset + SLOT_BYTES
                ]
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, SLOT_BYTES, offset)
