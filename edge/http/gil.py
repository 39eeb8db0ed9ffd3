"""The GIL's switch interval while a large request is parsed beside the event loop.

The parse of a request (schema checks, the RunRequest's serialization) runs in a
worker thread, so the loop goes on; but both run Python and share the GIL. At
CPython's switch interval (5 ms) each system call the loop makes while a thread works
on a large body can wait that long to get the GIL back (the convoy effect): with the
hostile mix's bodies of 16,000 messages being parsed, `/healthz` took up to 1.9 s (p99
1.3-1.9 s over 6 runs of its `all` phase); at 0.5 ms, 68-110 ms. A shorter interval
for good costs the hot path, whose threads hand each chunk across (A/B against the
default: 15-30% more CPU per chunk, and longer gaps between a paced stream's chunks),
so it is shortened only while a large parse runs (`GilShare.large`), and put back when
the last one ends.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

# A parse of this many bytes or more shortens the interval while it runs.
LARGE_BYTES = 256 * 1024
# The interval then (seconds).
SHARED_S = 0.0005


class GilShare:
    """Counts the large parses under way (on the event loop's thread only)."""

    __slots__ = ("_busy", "_default")

    def __init__(self) -> None:
        self._busy = 0
        self._default = sys.getswitchinterval()

    @contextmanager
    def large(self, nbytes: int) -> Iterator[None]:
        """While the block runs, a parse of `nbytes` bytes (when LARGE_BYTES or more) has
        the loop take the GIL back within SHARED_S."""
        if nbytes < LARGE_BYTES:
            yield
            return
        if self._busy == 0:
            self._default = sys.getswitchinterval()
            sys.setswitchinterval(SHARED_S)
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            if self._busy == 0:
                sys.setswitchinterval(self._default)
