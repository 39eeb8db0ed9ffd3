"""End to end: what the edge frees leaves its process.

`iop-edge` sets glibc's allocator (`edge.process.allocator`) so that a
large block, once freed, is given back to the system: a Python process with the
daemon's settings allocates 64 blocks of 1 MiB, each beside a small one that stays,
after an 8 MiB block came and went (which, with glibc's defaults, moves the mmap
threshold past 1 MiB: the blocks then come from the heap, and the small ones left
between them keep it resident). A real `iop-edge` says what it set in its startup
log, and leaves the allocator alone when the environment sets it.

Every wait is bounded; nothing asserts a duration.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from edge.process.allocator import OPERATOR_KNOBS, tune_allocator
from tests.integration.conftest import SimProcess
from tests.integration.edgeproc import edge_process

MiB = 1024 * 1024

# Runs in a fresh interpreter: prints the bytes the blocks took, then the bytes that stayed.
_BLOCKS = """
import os, sys
from edge.process.allocator import tune_allocator
print(tune_allocator({}), file=sys.stderr)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
big = b"\\x01" * (8 << 20)
del big
base = rss()
blocks, small = [], []
for _ in range(64):
    blocks.append(b"\\x01" * (1 << 20))
    small.append(bytes(1000))
held = rss()
del blocks
print(held - base, rss() - base)
"""


def test_freed_large_blocks_leave_the_process(tmp_path: Path) -> None:
    """With the daemon's allocator settings, 64 MiB of 1 MiB blocks, each beside a small
    block that stays, are back with the system once freed (under 8 MiB stays), after an
    8 MiB block came and went."""
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKS],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
    )
    assert "mmap threshold 64 KiB" in done.stderr, done.stderr
    held, stayed = (int(x) for x in done.stdout.split())
    assert held >= 48 * MiB  # the blocks were resident
    assert stayed < 8 * MiB, (held, stayed)


def test_the_operators_allocator_settings_win() -> None:
    """With any of glibc's own allocator knobs in the environment, nothing is set and the
    startup line says so."""
    for knob in OPERATOR_KNOBS:
        said = tune_allocator({knob: "4"})
        assert said == f"as the environment sets it ({knob})"


async def test_iop_edge_logs_its_allocator(tmp_path: Path, sim: SimProcess) -> None:
    """A real `iop-edge` logs the allocator settings it set at startup, or that the
    environment's are kept (MALLOC_ARENA_MAX set)."""
    toml = (
        f'[server]\nlisten = "127.0.0.1:0"\n\n[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
    )
    async with edge_process(tmp_path, toml, log_format="json") as edge:
        line = json.loads(await edge.wait_line("allocator: "))
        assert line["msg"] == "allocator: mmap threshold 64 KiB, 2 arenas at most"
    async with edge_process(
        tmp_path, toml, log_format="json", env={"MALLOC_ARENA_MAX": "4"}, name="env"
    ) as edge:
        line = json.loads(await edge.wait_line("allocator: "))
        assert line["msg"] == "allocator: as the environment sets it (MALLOC_ARENA_MAX)"
