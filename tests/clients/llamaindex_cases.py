"""LlamaIndex's cases, run by `test_llamaindex.py` in LlamaIndex's own venv.

    .venv-llamaindex/bin/python -m tests.clients.llamaindex_cases BASE_URL

`llama-index-llms-openai-like` 0.8.1 (the newest) needs `llama-index-llms-openai`,
which caps openai below 3: with the main venv's openai it cannot be installed
without a downgrade, so LlamaIndex and the openai release it allows live in
`.venv-llamaindex` (pins: `tests/clients/llamaindex-requirements.txt`, built by
`make setup`/`make test`). This module imports only those and
`tests.clients.scripts`. It runs every case and prints one JSON line: case
name -> "ok" or the failure's traceback.

`OpenAILike` with its defaults is not a chat model (`is_chat_model=False`):
`complete`, `stream_complete` and even `chat` go to `POST /v1/completions`,
without `max_tokens` (the edge's default of 16 applies, as OpenAI's and
vLLM's), which is what is tested here.
"""

from __future__ import annotations

from collections.abc import Callable

import openai
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike

from tests.clients.scripts import USAGE, say, script
from tests.clients.venvcases import main


def make_llm(base_url: str, model: str = "sim-script") -> OpenAILike:
    return OpenAILike(model=model, api_base=base_url, api_key="unused", max_retries=0)


def complete_with_usage(base_url: str) -> None:
    response = make_llm(base_url).complete(script(say("Hello from the edge")))
    assert response.text == "Hello from the edge", response.text
    assert response.raw is not None
    assert response.raw.object == "text_completion"
    assert response.raw.usage.completion_tokens == USAGE["output_tokens"]


def stream_complete(base_url: str) -> None:
    pieces = list(make_llm(base_url).stream_complete(script(say("one two three"))))
    assert [p.delta for p in pieces if p.delta] == ["one", " two", " three"], pieces
    assert pieces[-1].text == "one two three"


def chat_over_completions(base_url: str) -> None:
    messages = [ChatMessage(role="user", content="tell me about Paris")]
    response = make_llm(base_url, "sim-echo").chat(messages)
    assert response.message.role == "assistant"
    assert "tell me about Paris" in (response.message.content or ""), response


def unknown_model_is_404(base_url: str) -> None:
    try:
        make_llm(base_url, "no-such-model").complete("x")
    except openai.NotFoundError:
        return
    raise AssertionError("no NotFoundError")


CASES: dict[str, Callable[[str], None]] = {
    "complete_with_usage": complete_with_usage,
    "stream_complete": stream_complete,
    "chat_over_completions": chat_over_completions,
    "unknown_model_is_404": unknown_model_is_404,
}


if __name__ == "__main__":
    main(CASES)
