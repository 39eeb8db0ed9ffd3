"""The fleet benchmark's `cores_apart` (`benchmarks.stack`): a gateway on a CPU of its own
while a workload plays, on real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.stack import can_set_apart, cores_apart

needs_two = pytest.mark.skipif(not can_set_apart(), reason="needs Linux and two CPUs")


@needs_two
def test_the_gateway_has_the_last_cpu_alone_for_the_block_then_all_again() -> None:
    """Inside the block the process apart is on the last CPU only, its threads included,
    and the rest on every other CPU; after it, both are on all the CPUs again."""
    cpus = sorted(os.sched_getaffinity(0))
    script = (
        "import threading, sys; threading.Thread(target=sys.stdin.read).start(); sys.stdin.read()"
    )
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE) as child:
        try:
            with cores_apart([child.pid], [os.getpid()]) as done:
                assert done
                tasks = os.listdir(f"/proc/{child.pid}/task")
                assert {frozenset(os.sched_getaffinity(int(t))) for t in tasks} == {
                    frozenset({cpus[-1]})
                }
                assert os.sched_getaffinity(0) == set(cpus[:-1])
            assert os.sched_getaffinity(child.pid) == set(cpus)
            assert os.sched_getaffinity(0) == set(cpus)
        finally:
            child.kill()
