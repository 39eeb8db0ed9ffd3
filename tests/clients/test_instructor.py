"""Instructor against a real edge, from Instructor's own venv (see `instructor_cases`).

Every case runs in one `.venv-instructor/bin/python -m tests.clients.instructor_cases`
process (built by `make setup` / `make test` from
`tests/clients/instructor-requirements.txt`); each test here reports one case.
"""

from __future__ import annotations

import pytest

from tests.clients.venvcases import run_cases

CASES = (
    "tools_mode_with_usage",
    "json_mode",
    "streaming_partial_objects",
    "repaired_bad_call_with_max_retries",
    "mid_stream_error_is_raised",
    "unknown_model_is_404",
)


@pytest.fixture(scope="module")
def results(base_url: str) -> dict[str, str]:
    return run_cases(".venv-instructor", "tests.clients.instructor_cases", base_url, CASES)


@pytest.mark.parametrize("case", CASES)
def test_instructor(results: dict[str, str], case: str) -> None:
    """Each case of Instructor with the openai release it allows passes."""
    assert results[case] == "ok", results[case]
