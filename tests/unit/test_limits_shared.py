"""The shared-file store holds limits exactly across real processes (one edge's workers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from edge.limits.shared import SharedFileStore
from edge.limits.window import Limits

# A worker: wait for "go" on stdin, then try N requests of key "k"; print how many passed.
_WORKER = """
import sys, trio
from pathlib import Path
from edge.limits.shared import SharedFileStore
from edge.limits.window import Limits

directory, tries, rpm, streams, release = sys.argv[1:6]
limits = Limits(rpm=int(rpm) or None, max_streams=int(streams) or None)
store = SharedFileStore(Path(directory), [("k", limits), ("other", Limits(rpm=1))],
                        clock=lambda: 1_000)

async def main() -> None:
    admitted = 0
    for i in range(int(tries)):
        decision = await store.admit("k", limits, str(i))
        if decision.admitted:
            admitted += 1
            if release == "1":
                await store.release("k", str(i))
    print(admitted, flush=True)

print("ready", flush=True)
assert sys.stdin.readline().strip() == "go"
trio.run(main)
"""


def _workers(directory: Path, n: int, *args: object) -> list[subprocess.Popen[str]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(directory), *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
    for p in procs:  # both released together: their requests interleave
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


def _admitted(procs: list[subprocess.Popen[str]]) -> list[int]:
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        out.append(int(stdout.strip()))
    return out


def test_two_processes_share_one_rpm_exactly(tmp_path: Path) -> None:
    """rpm = 300, two processes try 400 requests each at once: exactly 300 pass in all."""
    counts = _admitted(_workers(tmp_path, 2, 400, 300, 0, 1))
    assert sum(counts) == 300


def test_two_processes_share_max_streams_exactly(tmp_path: Path) -> None:
    """max_streams = 5 held and never released by two processes: exactly 5 pass in all."""
    counts = _admitted(_workers(tmp_path, 2, 50, 0, 5, 0))
    assert sum(counts) == 5


async def test_streams_of_a_dead_process_are_given_back(tmp_path: Path) -> None:
    """A worker that died holding streams does not hold them forever: at the limit, the
    streams of pids that are gone are reclaimed."""
    assert _admitted(_workers(tmp_path, 1, 3, 0, 3, 0)) == [3]  # holds 3, then exits
    limits = Limits(max_streams=3)
    store = SharedFileStore(tmp_path, [("k", limits), ("other", Limits(rpm=1))], clock=lambda: 1)
    try:
        assert (await store.admit("k", limits, "a")).admitted
        assert (await store.admit("k", limits, "b")).admitted
        assert (await store.admit("k", limits, "c")).admitted
        assert (await store.admit("k", limits, "d")).over == "streams"
        await store.release("k", "a")
        assert (await store.admit("k", limits, "e")).admitted
    finally:
        await store.aclose()


async def test_a_count_not_renewed_expires_with_its_lease(tmp_path: Path) -> None:
    """A stream whose release never ran (a count this process got wrong) holds the key's
    max_streams for one lease at most: past it, unrenewed, it no longer counts."""
    now = [1_000]
    limits = Limits(max_streams=1)
    store = SharedFileStore(tmp_path, [("k", limits)], clock=lambda: now[0], lease_ms=500)
    try:
        assert (await store.admit("k", limits, "leaked")).admitted
        now[0] += 499
        assert (await store.admit("k", limits, "b")).over == "streams"
        now[0] += 1
        assert (await store.admit("k", limits, "c")).admitted
    finally:
        await store.aclose()


async def test_a_renewal_keeps_live_streams_and_drops_leaked_ones(tmp_path: Path) -> None:
    """A renewal sets this process's count to the streams its live requests hold, another
    lease ahead: live ones stay counted past the first lease, a leaked one is dropped."""
    now = [1_000]
    limits = Limits(max_streams=2)
    store = SharedFileStore(tmp_path, [("k", limits)], clock=lambda: now[0], lease_ms=500)
    try:
        assert (await store.admit("k", limits, "live")).admitted
        assert (await store.admit("k", limits, "leaked")).admitted
        for _ in range(4):  # four lease periods, renewed every 300 ms
            now[0] += 300
            await store.renew({"k": {"live"}})
        assert (await store.admit("k", limits, "b")).admitted  # live + b: 2
        assert (await store.admit("k", limits, "c")).over == "streams"
        await store.renew({"k": set()})  # none held any more
        assert (await store.admit("k", limits, "d")).admitted
    finally:
        await store.aclose()


async def test_a_new_set_of_limited_keys_keeps_the_counts_of_those_that_stay(
    tmp_path: Path,
) -> None:
    """`rekey` (a reload that adds and removes limited keys): the file of the new names
    holds the counts of the keys in both; a key added starts empty; calls for a key
    removed count nothing (its request under way ends without an error)."""
    limits = Limits(rpm=2, max_streams=5)
    store = SharedFileStore(tmp_path, [("a", limits), ("b", limits)], clock=lambda: 1_000)
    try:
        assert (await store.admit("a", limits, "1")).admitted
        assert (await store.admit("b", limits, "2")).admitted
        before = store.path
        store.rekey([("a", limits), ("c", limits)])
        assert store.path != before
        second = await store.admit("a", limits, "3")
        assert second.admitted
        assert second.requests == 2
        assert second.streams == 2
        assert (await store.admit("a", limits, "4")).over == "requests"
        assert (await store.admit("c", limits, "5")).requests == 1
        await store.release("b", "2")
        await store.add_tokens("b", 10)
        assert (await store.admit("b", limits, "6")).admitted  # counted nowhere
    finally:
        await store.aclose()
