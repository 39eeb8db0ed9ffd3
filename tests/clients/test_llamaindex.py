"""LlamaIndex's `OpenAILike` against a real edge, from LlamaIndex's own venv (see
`llamaindex_cases`).

Every case runs in one `.venv-llamaindex/bin/python -m tests.clients.llamaindex_cases`
process (built by `make setup` / `make test` from
`tests/clients/llamaindex-requirements.txt`); each test here reports one case.
"""

from __future__ import annotations

import pytest

from tests.clients.venvcases import run_cases

CASES = (
    "complete_with_usage",
    "stream_complete",
    "chat_over_completions",
    "unknown_model_is_404",
)


@pytest.fixture(scope="module")
def results(base_url: str) -> dict[str, str]:
    return run_cases(".venv-llamaindex", "tests.clients.llamaindex_cases", base_url, CASES)


@pytest.mark.parametrize("case", CASES)
def test_llamaindex(results: dict[str, str], case: str) -> None:
    """Each case of `OpenAILike` with its defaults (legacy completions) passes."""
    assert results[case] == "ok", results[case]
