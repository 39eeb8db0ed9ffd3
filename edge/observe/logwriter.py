"""The one writer of a process's log lines: a bounded queue, one thread, never a wait.

Why not loguru's `enqueue=True`: it puts each record, pickled, into a
`multiprocessing.SimpleQueue`, which is an OS pipe (64 KiB on Linux) that one
thread drains into the sink. When the sink's reader is slow (stderr a pipe
nobody reads), that thread blocks in its write, the queue's pipe fills, and
the next `put`, made by whoever logs (the trio loop), blocks in its own
write: the edge stops answering after a few hundred lines. And a record of
any size goes through that pipe whole, while the logging thread waits.

Here a line is handed over already formatted and bounded (`edge.observe.logbound`)
and appended to an in-memory queue bounded in bytes: `put` never waits.
When the queue is full the line is dropped and counted (`on_drop`, wired to
`iop_edge_log_lines_dropped_total`). One thread writes the queued lines to the
descriptor, blocking as long as the reader makes it; once it has written
again after drops, it says how many lines were dropped (`on_caught_up`), at
most once a second.

Worker processes share their supervisor's stderr: each writes whole lines,
in writes of at most PIPE_BUF bytes where the lines allow (what a pipe
writes atomically), so lines of different processes never interleave.
"""

from __future__ import annotations

import math
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable

# What a queued line costs besides its bytes (the bytes object, the deque slot):
# counted against the bound so that a flood of short lines is bounded too.
LINE_OVERHEAD = 64
# "N log lines dropped" at most this often.
NOTICE_EVERY_S = 1.0


def fd_writer(fd: int) -> Callable[[bytes], None]:
    """Write all of `data` to `fd`, waiting as long as it takes (the writer's thread only).

    A descriptor someone made non-blocking is waited on with `select`; OSError
    (EPIPE: the reader is gone) is the caller's.
    """

    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                select.select([], [fd], [])
                continue
            view = view[written:]

    return write


class LineWriter:
    """Lines queued by any thread, written by one; at most `max_bytes` queued.

    Args:
        write: writes one chunk of whole lines, blocking (`fd_writer`).
        max_bytes: the queue's bound, counting LINE_OVERHEAD per line.
        on_caught_up: called on the writer's thread with the lines dropped since
            its last call, once lines are written again (it logs a line saying so).
    """

    def __init__(
        self,
        write: Callable[[bytes], None],
        *,
        max_bytes: int,
        on_caught_up: Callable[[int], None] | None = None,
    ) -> None:
        self._write = write
        self._max_bytes = max_bytes
        self._on_caught_up = on_caught_up
        # Called with 1 for each line dropped, on the thread that dropped it.
        self.on_drop: Callable[[int], object] | None = None
        self.dropped = 0  # since the start
        self._unreported = 0  # since the last on_caught_up
        self._lock = threading.Lock()
        self._has_lines = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._lines: deque[bytes] = deque()
        self._bytes = 0
        self._writing = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="iop-edge-log-writer", daemon=True)
        self._thread.start()

    def put(self, line: str) -> None:
        """Queue `line` (a whole line, with its newline), or drop it when the queue is full."""
        data = line.encode("utf-8", "backslashreplace")
        cost = len(data) + LINE_OVERHEAD
        with self._lock:
            if self._bytes + cost <= self._max_bytes and not self._stopping:
                self._lines.append(data)
                self._bytes += cost
                self._has_lines.notify()
                return
        self._count_dropped(1)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every line queued so far is written, at most `timeout_s`; whether it was."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._lines or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def stop(self, timeout_s: float) -> bool:
        """Flush (at most `timeout_s`), then end the thread; lines put after are dropped."""
        flushed = self.flush(timeout_s)
        with self._lock:
            self._stopping = True
            self._has_lines.notify()
        if flushed:
            self._thread.join(timeout_s)
        return flushed

    def _count_dropped(self, lines: int) -> None:
        with self._lock:
            self.dropped += lines
            self._unreported += lines
        on_drop = self.on_drop
        if on_drop is not None:
            on_drop(lines)

    def _run(self) -> None:
        noticed_at = -math.inf
        while True:
            with self._lock:
                while not self._lines and not self._stopping:
                    due = self._unreported and self._on_caught_up is not None
                    wait = noticed_at + NOTICE_EVERY_S - time.monotonic() if due else None
                    if wait is not None and wait <= 0:
                        break
                    self._has_lines.wait(wait)
                if self._stopping and not self._lines:
                    return
                batch, self._lines, self._bytes = self._lines, deque(), 0
                self._writing = True
            try:
                self._write_lines(batch)
            finally:
                with self._lock:
                    self._writing = False
                    self._idle.notify_all()
                    unreported = self._unreported
            if unreported and time.monotonic() - noticed_at >= NOTICE_EVERY_S:
                noticed_at = time.monotonic()
                with self._lock:
                    self._unreported -= unreported
                if self._on_caught_up is not None:
                    self._on_caught_up(unreported)

    def _write_lines(self, lines: deque[bytes]) -> None:
        """Write `lines` in chunks of whole lines of at most PIPE_BUF bytes (a longer
        line alone); the lines of a chunk that cannot be written are dropped."""
        chunk: list[bytes] = []
        size = 0
        for line in lines:
            if chunk and size + len(line) > select.PIPE_BUF:
                self._write_chunk(chunk)
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            self._write_chunk(chunk)

    def _write_chunk(self, chunk: list[bytes]) -> None:
        try:
            self._write(b"".join(chunk))
        except (OSError, ValueError):  # the reader is gone, the stream closed
            self._count_dropped(len(chunk))
