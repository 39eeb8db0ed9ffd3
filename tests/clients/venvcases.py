"""Clients that need a venv of their own (Instructor, LlamaIndex): their cases run in
one process of that venv, and each pytest test reports one case.

The cases module (`tests.clients.<name>_cases`, run by the venv's python from the repo
root) calls `main(CASES)`: every case runs, and one JSON line says each one's result
(case name -> "ok" or the failure's traceback). The pytest side calls `run_cases` once
a module. Standard library only: both venvs import this.
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES_TIMEOUT_S = 120.0


def main(cases: Mapping[str, Callable[[str], None]]) -> None:
    """Run every case against the edge at argv[1]; print the results as one JSON line."""
    base_url = sys.argv[1]
    results: dict[str, str] = {}
    for name, case in cases.items():
        try:
            case(base_url)
        except Exception:  # a failed case is reported, the others still run
            results[name] = traceback.format_exc()
        else:
            results[name] = "ok"
    print(json.dumps(results))


def run_cases(venv: str, module: str, base_url: str, names: Sequence[str]) -> dict[str, str]:
    """The results of `module`'s cases, run by `venv`'s python (`make setup` builds it)."""
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        raise AssertionError(f"{venv}/bin/python is missing: run `make setup`")
    done = subprocess.run(
        [str(python), "-m", module, base_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CASES_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(seen) == sorted(names)
    return seen
