"""A CPU yardstick measured in the same run: the unit CPU figures are divided by.

Absolute CPU times drift on a shared machine (other load, frequency scaling, noisy
neighbours). `calibrate()` times a fixed pure-Python workload shaped like the edge's
per-chunk work (build a small dict, JSON-encode it, bytes concatenation, a dict lookup)
and returns the best of several repetitions in microseconds per operation. A figure
"in calibration units" (edge us/chunk divided by this) compares across runs and
machines better than the raw microseconds.
"""

from __future__ import annotations

import json
import time

_OPS = 2000
_REPS = 7


def _op(i: int, head: bytes, table: dict[str, int]) -> bytes:
    delta = {"content": f"tok{i & 7}"}
    frame = head + json.dumps(delta, separators=(",", ":")).encode() + b"}\n\n"
    table[delta["content"]] = table.get(delta["content"], 0) + len(frame)
    return frame


def calibrate() -> float:
    """Microseconds per yardstick operation (best of several repetitions)."""
    head = b'data: {"id":"chatcmpl-0123456789abcdef","choices":[{"index":0,"delta":'
    best = float("inf")
    for _ in range(_REPS):
        table: dict[str, int] = {}
        t0 = time.perf_counter()
        for i in range(_OPS):
            _op(i, head, table)
        best = min(best, time.perf_counter() - t0)
    return best / _OPS * 1e6


if __name__ == "__main__":
    print(f"{calibrate():.3f} us per op")
