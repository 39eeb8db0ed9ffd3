"""The C allocator's settings for the daemon's process (glibc only; elsewhere nothing).

Freed memory that glibc's malloc keeps is resident all the same, and the
edge's peaks are made of large blocks that come and go: request bodies of
up to `max_body_bytes`, their parse buffers, answer batches. Two of glibc's
defaults keep such blocks long after they are freed:

- The mmap threshold moves. A block of 128 KiB or more is mapped on its own
  and unmapped when freed, but each such block freed raises the threshold to
  its size (up to 32 MiB): after the first 4 MB body, blocks under 4 MB come
  from the heap, and a heap gives back only its top, so a few blocks still in
  use keep every freed one below them resident. A threshold set once no
  longer moves: a block of 64 KiB or more is given back to the system as it
  is freed (an mmap and a munmap, and its pages faulted in once: a few
  microseconds per 64 KiB). 64 KiB, not glibc's starting 128: the blocks of
  64-128 KiB are the large deltas and the answer chunks rendered from them,
  which a stream whose client stopped reading keeps for as long as it waits,
  among the heap's short-lived ones (a token's delta and chunk are far
  smaller, and never mapped). A client connection's reads are just under it
  (`edge.http.connection.MAX_RECV`); the node hop's (asyncio's 256 KiB) are
  mapped, one mapping a read of many frames.
- Every thread that allocates while another does gets an arena of its own
  (up to 8 per CPU), each with a high-water mark of its own. The edge's
  threads (the event loop, the node bridge, the parse threads, the log
  writer) run Python, which holds the GIL: their allocations seldom overlap,
  so more arenas buy little but more high-water marks. Two are kept.

Measured with the hostile mix's `all` phase (every attack at once, beside
normal traffic): the RSS peak above idle was +224..309 MiB with glibc's
defaults (3 runs) and +192..266 MiB with both settings (11 runs), the heap's
free bytes at the peak 50..139 MiB and 13..29 MiB. Either setting alone did
about half as well (+213..298 and +226..248, 3 to 4 runs each). A threshold of
64 KiB against 128 KiB, alternating on a quiet machine: +225..266 MiB (mean 249,
7 runs) against +251..310 (mean 275); 32 KiB did no better than 64 (+243..262).

An operator's own choice wins: with MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES in the environment, nothing is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Mapping

# mallopt's parameters (glibc's malloc.h).
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# Blocks this large or larger are mapped on their own (fixed: see the module doc).
MMAP_THRESHOLD = 64 * 1024
ARENA_MAX = 2
# An operator who set any of these chose the allocator's settings.
OPERATOR_KNOBS = (
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "GLIBC_TUNABLES",
)


def tune_allocator(environ: Mapping[str, str] = os.environ) -> str:
    """Set the daemon's allocator settings (the module doc), before any thread starts.
    Returns what was done, for the startup log."""
    chosen = [name for name in OPERATOR_KNOBS if name in environ]
    if chosen:
        return f"as the environment sets it ({', '.join(chosen)})"
    if platform.libc_ver()[0] != "glibc":
        return "the platform's defaults (not glibc)"
    path = ctypes.util.find_library("c")
    if path is None:
        return "the platform's defaults (no C library found)"
    mallopt = ctypes.CDLL(path).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    threshold = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    arenas = mallopt(M_ARENA_MAX, ARENA_MAX)
    if not (threshold and arenas):
        return f"mallopt refused a setting (mmap threshold: {threshold}, arena max: {arenas})"
    return f"mmap threshold {MMAP_THRESHOLD // 1024} KiB, {ARENA_MAX} arenas at most"
