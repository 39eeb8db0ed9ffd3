"""The Pythons the edge supports: the range `pyproject.toml` declares is the one the docs
say is verified, and every process that runs grpclib on the trio-asyncio bridge imports
trio_asyncio first (without it, from CPython 3.12, every call to a node fails with "no
running event loop": `edge.node` says why).

The import order is a property of each process, so each case runs in a fresh interpreter
of its own; it holds (or not) on every Python, so this suite catches on 3.11 what would
break only on 3.12 and later.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]

# Where a process that talks to nodes through the bridge starts: the daemon (iop-edge and
# its workers), the nodes it serves inside itself, the node client, the benchmarks' jobs
# that drive the node client, and this test suite (its conftest, then a test module that
# imports a node's server).
BRIDGE_PROCESSES = [
    "edge.process.daemon",
    "edge.nodes.embedded",
    "edge.node.client",
    "benchmarks.jobs.direct",
    "benchmarks.cli",
    "tests.conftest, tests.unit.test_nodekit",
]
# Node processes run grpclib on a plain asyncio loop and leave asyncio as it is.
NODE_PROCESSES = ["edge.nodes.sim.cli", "edge.nodes.upstream.cli"]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("module", BRIDGE_PROCESSES)
def test_a_bridge_process_imports_trio_asyncio_before_grpclib(module: str) -> None:
    """Importing the module a bridge process starts from loads trio_asyncio before grpclib
    (or grpclib not at all): the bridge then opens."""
    done = _python(
        f"import {module}, sys; from edge.node.bridge import grpclib_came_first;"
        " assert 'trio_asyncio' in sys.modules; assert not grpclib_came_first()"
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("module", NODE_PROCESSES)
def test_a_node_process_leaves_asyncio_alone(module: str) -> None:
    """A node's command never imports trio_asyncio (which would make asyncio.run a trio
    run under asyncio: several times the CPU per run)."""
    done = _python(f"import {module}, sys; assert 'trio_asyncio' not in sys.modules")
    assert done.returncode == 0, done.stderr


def test_the_bridge_refuses_to_open_where_grpclib_came_first() -> None:
    """A process that imported grpclib before trio_asyncio gets a clear error when it opens
    the bridge, on every Python, not a node marked down at each call from 3.12 on."""
    done = _python(
        "import grpclib.client, trio; from edge.node.bridge import asyncio_loop\n"
        "async def main():\n"
        "    async with asyncio_loop():\n"
        "        pass\n"
        "trio.run(main)"
    )
    assert done.returncode != 0
    assert "grpclib was imported before trio_asyncio" in done.stderr
    assert "import edge.node first" in done.stderr


def _minors(spec: SpecifierSet) -> list[str]:
    return [f"3.{m}" for m in range(0, 30) if Version(f"3.{m}") in spec]


def _verified() -> list[str]:
    """The versions docs/operations.md says are verified."""
    text = (ROOT / "docs" / "operations.md").read_text()
    found = re.search(r"verified on CPython ((?:3\.\d+)(?:(?:, | and )3\.\d+)*)", text)
    assert found, "docs/operations.md names no verified Python versions"
    return re.findall(r"3\.\d+", found.group(1))


def test_the_declared_range_is_the_verified_one() -> None:
    """`requires-python` admits exactly the minor versions the docs say are verified; the
    README and the getting-started page name the same; lint and types target the lowest;
    this suite runs on one of them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    spec = SpecifierSet(project["project"]["requires-python"])
    declared = _minors(spec)
    assert declared == _verified()
    said = ", ".join(declared[:-1]) + " or " + declared[-1]
    for page in ("README.md", "docs/getting-started.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert f"Python {said}" in text, page
    lowest = declared[0]
    assert project["tool"]["ruff"]["target-version"] == "py" + lowest.replace(".", "")
    assert project["tool"]["mypy"]["python_version"] == lowest
    assert Version(f"{sys.version_info.major}.{sys.version_info.minor}") in spec
