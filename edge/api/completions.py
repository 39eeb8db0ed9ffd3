"""Decode a `POST /v1/completions` body (OpenAI's legacy completions) into a `ChatRequest`.

The node contract carries messages, not a raw prompt (`RunRequest.messages`;
the node applies its model's chat template), so a legacy completion is run
as a chat turn: the prompt becomes one user message, and every other field
is the chat request's of the same name, which `chat_request_from` validates
(its rules and limits hold here too, `n` included: only 1). What differs:

- `prompt`: a string, or a list of one string. A list of several prompts is
  refused (each is its own request: send them one by one), and so are token
  ids (the edge does not tokenize: send text).
- `max_tokens`: 16 when absent, as OpenAI's and vLLM's legacy endpoint.
- `logprobs`: an integer N, 0 to 20: each token's log-probability and its N
  most likely alternatives (chat's `logprobs: true, top_logprobs: N`).
- `echo`: the prompt comes back before the answer's text; not with
  `logprobs` (the nodes give no log-probabilities of prompt tokens).
- `suffix` (insertion) is refused, and so is `best_of` above 1.
- reasoning is not asked for and never shown: the shape has no place for it.

Pure: bytes in, values out (or a `RequestError`). No HTTP, no trio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec

from edge.api.request import ChatRequest, chat_request_from, decode_object, deep_is_refused
from edge.errors import RequestError
from edge.stream.logprobs import MAX_TOP_LOGPROBS

# Passed to the chat request as sent (their checks and errors are chat's).
_PASSED: Final = (
    "model", "stream", "stream_options", "temperature", "top_p", "n", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "metadata",
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
    "strict_output", "stream_buffer",
)  # fmt: skip
# OpenAI's (and vLLM's) default for a legacy completion without max_tokens.
DEFAULT_MAX_TOKENS: Final = 16
_MISSING: Final = object()


@dataclass(frozen=True, slots=True)
class CompletionsRequest:
    """A validated legacy completions request, as the run's request."""

    chat: ChatRequest
    # `echo`: the prompt, as a JSON string (encoded here, off the event loop), else None.
    echo_json: bytes | None = None
    # The prompt's length in characters when echoed (where the answer's text starts).
    echo_chars: int = 0


@deep_is_refused
def parse_completions_request(body: bytes) -> CompletionsRequest:
    """Decode, translate and validate a legacy completions request body.

    Raises:
        RequestError: the body breaks a rule of the API (or of chat requests);
            `param` names the field.
    """
    obj = decode_object(body)
    prompt = _prompt(obj.get("prompt", _MISSING))
    if obj.get("suffix") is not None:
        raise RequestError(
            "'suffix' is not supported: the nodes complete a prompt, they do not insert"
            " between a prompt and a suffix. Send the request without 'suffix'.",
            param="suffix",
        )
    best_of = obj.get("best_of")
    if best_of is not None and best_of != 1:
        raise RequestError(
            f"Only best_of=1 is supported; got best_of={best_of!r}.", param="best_of"
        )
    echo = obj.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise RequestError("Invalid type for 'echo': expected a boolean.", param="echo")
    chat: dict[str, Any] = {name: obj[name] for name in _PASSED if name in obj}
    chat["messages"] = [{"role": "user", "content": prompt}]
    max_tokens = obj.get("max_tokens")
    chat["max_tokens"] = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    chat["include_reasoning"] = False
    logprobs = obj.get("logprobs")
    if logprobs is not None:
        if type(logprobs) is not int or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"Invalid 'logprobs': expected an integer from 0 to {MAX_TOP_LOGPROBS}"
                f" (the number of most likely tokens given with each), got {logprobs!r}.",
                param="logprobs",
            )
        if echo:
            raise RequestError(
                "'echo' with 'logprobs' is not supported: the nodes give no"
                " log-probabilities of prompt tokens. Send one of them.",
                param="echo",
            )
        chat["logprobs"] = True
        chat["top_logprobs"] = logprobs
    request = chat_request_from(chat)
    if not echo:
        return CompletionsRequest(request)
    return CompletionsRequest(request, msgspec.json.encode(prompt), len(prompt))


def _prompt(value: object) -> str:
    """The one prompt of `prompt`: a string, or a list of one string."""
    if value is _MISSING or value is None:
        raise RequestError("Missing required parameter: 'prompt'.", param="prompt")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError(
            "Invalid type for 'prompt': expected a string or an array of strings.", param="prompt"
        )
    if not value:
        raise RequestError("Invalid 'prompt': an empty array; send one prompt.", param="prompt")
    if any(not isinstance(item, str) for item in value):
        if all(isinstance(item, int | list) for item in value):
            raise RequestError(
                "Invalid 'prompt': token ids are not supported (the edge does not tokenize"
                " for the nodes' models); send the prompt as text.",
                param="prompt",
            )
        raise RequestError(
            "Invalid type for 'prompt': expected a string or an array of strings.", param="prompt"
        )
    if len(value) > 1:
        raise RequestError(
            f"Invalid 'prompt': {len(value)} prompts in one request; this edge answers one"
            " prompt per request: send each prompt as its own request.",
            param="prompt",
        )
    prompt: str = value[0]
    return prompt
