"""LlamaIndex's `OpenAILike` against a real edge, from LlamaIndex's own venv (see
`llamaindex_cases`).

Every case runs in one `.venv-llamaindex/bin/python -m tests.clients.llamaindex_cases`
process (built by `make setup` / `make test` from
`tests/clients/llamaindex-requirements.txt`); each test here reports one case.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMAINDEX_PYTHON = ROOT / ".venv-llamaindex" / "bin" / "python"
CASES = (
    "complete_with_usage",
    "stream_complete",
    "chat_over_completions",
    "unknown_model_is_404",
)
CASES_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def results(base_url: str) -> dict[str, str]:
    if not LLAMAINDEX_PYTHON.exists():
        pytest.fail(f"{LLAMAINDEX_PYTHON.relative_to(ROOT)} is missing: run `make setup`")
    done = subprocess.run(
        [str(LLAMAINDEX_PYTHON), "-m", "tests.clients.llamaindex_cases", base_url],
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
def test_llamaindex(results: dict[str, str], case: str) -> None:
    """Each case of `OpenAILike` with its defaults (legacy completions) passes."""
    assert results[case] == "ok", results[case]
