"""The import graph, and the module names written in prose, agree with the code.

Invariants:
- A module of edge/ or benchmarks/ imports only from its own layer or the layers below
  it (pyproject.toml, [tool.importlinter]: one list per package, top to bottom), and no
  modules, nor packages, import one another in a circle, except the cycles listed there
  as known (reported as warnings until the layout move removes them). Every import
  counts, lazy ones and those under TYPE_CHECKING too. `make imports` runs the same check.
- Every backticked dotted name `edge.x.y` or `benchmarks.x.y` in edge/ and benchmarks/
  (docstrings, comments) names a module that exists, or a name defined at the top of one.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"`((?:edge|benchmarks)(?:\.[A-Za-z_]\w*)+)")
# Stale references in files that other branches are editing now: fix them there, then
# take them off this list. (file, reference)
KNOWN_STALE: set[tuple[str, str]] = set()


def test_imports_follow_the_layers_and_make_no_cycle() -> None:
    lint = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    done = subprocess.run(
        [sys.executable, "-c", lint, "--no-cache", "--no-logo"],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_module_names_in_prose_exist() -> None:
    stale = []
    for package in ("edge", "benchmarks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_proto" in path.parts:
                continue
            name = path.relative_to(ROOT).as_posix()
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for match in REFERENCE.finditer(line):
                    reference = match.group(1)
                    if (name, reference) not in KNOWN_STALE and not _resolves(reference):
                        stale.append(f"{name}:{number}: `{reference}`")
    assert not stale, "names no module, nor a name in one:\n" + "\n".join(stale)


def _resolves(reference: str) -> bool:
    """The longest prefix that is a module, then (if anything is left) a name in it."""
    parts = reference.split(".")
    for end in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:end])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            return end == len(parts) or parts[end] in _top_names(module)
    return False


@cache
def _top_names(module: Path) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)
