"""`make bench BENCH_ARGS=--calls` runs end to end on this tree: each workload's two
profiled runs, the calls per request of each, the JSON and the table, and nothing left
in the temporary directory; and its profiler counts every thread of a program."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.callstats import load

ROOT = Path(__file__).resolve().parents[2]
RUN_S = 300.0  # four edges started under cProfile, on a loaded 2-core machine


def test_the_call_count_mode_reports_calls_per_request_of_this_tree(tmp_path: Path) -> None:
    """Small runs (2 warm-up, then 5 and 15 requests) of a non-streamed request and a
    stream of 5 chunks: each gets a positive count of calls per request, from its two
    runs' profiles, with the edge code of this tree; every content frame of a stream
    arrived; the run removes its temporary directory."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "calls.json"
    argv = ["-m", "benchmarks", "--calls", "--calls-requests", "5,15", "--calls-warmup", "2"]
    argv += ["--calls-workloads", "nonstream,stream5", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["edge_code"]["A"] == str(ROOT / "edge" / "__init__.py")
    assert [w["name"] for w in result["workloads"]] == ["nonstream", "stream5"]
    for workload in result["workloads"]:
        side = workload["sides"]["A"]
        assert side["per_request"] > 0, workload
        small, large = side["runs"]
        assert (small["requests"], large["requests"]) == (5, 15)
        assert large["calls"] > small["calls"] > 0
    stream = result["workloads"][1]["sides"]["A"]["runs"]
    assert all(run["content_frames_per_request"] > 0 for run in stream)
    assert "| non-stream request " in done.stdout
    assert "| stream of 5 chunks: per chunk " in done.stdout
    assert "a proxy for CPU" in done.stdout
    assert not list(tmp.iterdir())


PROGRAM = """
import sys, threading

def work():
    pass

def in_thread():
    for _ in range(3):
        work()

def on_main():
    pass

thread = threading.Thread(target=in_thread)
thread.start()
thread.join()
on_main()
sys.exit(3)
"""


def test_every_thread_of_the_program_is_profiled_and_its_exit_status_kept(
    tmp_path: Path,
) -> None:
    """`benchmarks/threadprofile.py`, run by its path: the main thread's calls go to
    OUT, a thread's started through `threading` to OUT.threads, and the program's own
    exit status is the script's."""
    (tmp_path / "program.py").write_text(PROGRAM)
    out = tmp_path / "run.prof"
    done = subprocess.run(
        [sys.executable, "-P", str(ROOT / "benchmarks" / "threadprofile.py"), str(out),
         "-m", "program"],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    main = load(out, (str(tmp_path),))
    threads = load(Path(f"{out}.threads"), (str(tmp_path),))
    assert main[("program.py", "on_main")] == 1
    assert ("program.py", "work") not in main
    assert threads[("program.py", "work")] == 3
    assert ("program.py", "on_main") not in threads
