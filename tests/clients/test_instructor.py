"""Instructor against a real edge, from Instructor's own venv (see `instructor_cases`).

Every case runs in one `.venv-instructor/bin/python -m tests.clients.instructor_cases`
process (built by `make setup` / `make test` from
`tests/clients/instructor-requirements.txt`); each test here reports one case.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTRUCTOR_PYTHON = ROOT / ".venv-instructor" / "bin" / "python"
CASES = (
    "tools_mode_with_usage",
    "json_mode",
    "streaming_partial_objects",
    "repaired_bad_call_with_max_retries",
    "mid_stream_error_is_raised",
    "unknown_model_is_404",
)
CASES_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def results(base_url: str) -> dict[str, str]:
    if not INSTRUCTOR_PYTHON.exists():
        pytest.fail(f"{INSTRUCTOR_PYTHON.relative_to(ROOT)} is missing: run `make setup`")
    done = subprocess.run(
        [str(INSTRUCTOR_PYTHON), "-m", "tests.clients.instructor_cases", base_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CASES_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(seen) == sorted(CASES)
    return seen


@pytest.mark.parametrize("case", CASES)
def test_instructor(results: dict[str, str], case: str) -> None:
    assert results[case] == "ok", results[case]
