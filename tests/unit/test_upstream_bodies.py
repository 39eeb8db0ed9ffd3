"""Tests of iop-node's reading of error bodies and model lists (`edge.nodes.upstream.bodies`)."""

from __future__ import annotations

import json

import pytest

from edge.nodes.upstream.bodies import (
    MAX_ERROR_CHARS,
    UpstreamError,
    context_limits_from_body,
    error_message,
    models_from_body,
    upstream_error,
)
from tests.unit.upstream_replay import FIXTURES


@pytest.mark.parametrize(
    ("status", "raw", "expected"),
    [
        (
            400,
            (FIXTURES / "vllm-too-long.400.json").read_bytes(),
            "upstream returned 400: This model's maximum context length is 32768 tokens.",
        ),
        (
            503,
            (FIXTURES / "llamacpp-loading.503.json").read_bytes(),
            "upstream returned 503: Loading model",
        ),
        (
            404,
            (FIXTURES / "ollama-missing.404.json").read_bytes(),
            'upstream returned 404: model "llama3.2" not found',
        ),
        (401, b'{"error": "unauthorized"}', "upstream returned 401: unauthorized"),
        (422, b'{"detail": [{"loc": ["body"]}]}', 'upstream returned 422: [{"loc": ["body"]}]'),
        (502, b"Bad Gateway\n", "upstream returned 502: Bad Gateway"),
        (500, b"", "upstream returned 500: Internal Server Error"),
    ],
)
def test_error_bodies(status: int, raw: bytes, expected: str) -> None:
    """Each server's error body gives `upstream returned STATUS: message`."""
    assert error_message(status, raw, "Internal Server Error").startswith(expected)


def test_error_message_is_bounded() -> None:
    """A huge error body is quoted, not copied."""
    assert len(error_message(500, b"x" * 100_000)) < 600


def test_models_from_body_shapes() -> None:
    """OpenAI's data list and llama.cpp/Ollama's models list both give ids."""
    assert models_from_body(b'{"object":"list","data":[{"id":"a","owned_by":"vllm"}]}') == [
        ("a", "vllm")
    ]
    assert models_from_body(b'{"models":[{"name":"qwen3:8b","model":"qwen3:8b"}]}') == [
        ("qwen3:8b", "")
    ]
    with pytest.raises(ValueError, match="no model list"):
        models_from_body(b'{"object":"list"}')


def test_context_limits_from_body() -> None:
    """vLLM's and SGLang's `max_model_len` is each model's context length; a value that
    is not a whole number in the uint32 range, or a list without it, gives none."""
    body = (FIXTURES / "metrics" / "vllm-models.json").read_bytes()
    assert context_limits_from_body(body) == {"Qwen/Qwen3-8B": 40960}
    items = [
        {"id": "a", "max_model_len": 0},
        {"id": "b", "max_model_len": 2**32},
        {"id": "c", "max_model_len": "8192"},
        {"id": "d", "max_model_len": True},
        {"id": "e", "max_model_len": 1.5e3},
        {"id": "f"},
        {"max_model_len": 4096},
        "g",
    ]
    assert context_limits_from_body(json.dumps({"data": items}).encode()) == {}
    assert context_limits_from_body(b'{"models":[{"name":"qwen3:8b"}]}') == {}
    assert context_limits_from_body(b"not json") == {}


VLLM_OLD = (FIXTURES / "vllm-too-long.400.json").read_bytes()
VLLM_WORDS = (
    "This model's maximum context length is 32768 tokens. However, you requested 40000 tokens"
    " (8000 in the messages, 32000 in the completion). Please reduce the length of the"
    " messages or completion."
)
LLAMACPP_TOO_LONG = (
    b'{"error":{"code":400,"message":"the request exceeds the available context size,'
    b' try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,'
    b'"n_ctx":8192}}'
)
OPENAI_TOO_LONG = (
    b'{"error":{"message":"This model\'s maximum context length is 8192 tokens.",'
    b'"type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}'
)
VLLM_NEW_BAD = (
    b'{"error":{"message":"temperature must be non-negative, got -1.0.",'
    b'"type":"BadRequestError","param":null,"code":400}}'
)
VLLM_NO_MODEL = (
    b'{"object":"error","message":"The model `gpt-x` does not exist.","type":"NotFoundError",'
    b'"param":null,"code":404}'
)


@pytest.mark.parametrize(
    ("status", "raw", "expected"),
    [
        # vLLM (older shape, top-level): context length, recognised by its words.
        (400, VLLM_OLD, UpstreamError(400, "context_length_exceeded", VLLM_WORDS)),
        # vLLM (newer shape, under "error"): an invalid parameter, no code of its own.
        (400, VLLM_NEW_BAD, UpstreamError(400, "", "temperature must be non-negative, got -1.0.")),
        # llama.cpp: its error type says the context is exceeded.
        (400, LLAMACPP_TOO_LONG, UpstreamError(400, "context_length_exceeded",
         "the request exceeds the available context size, try increasing it")),
        # OpenAI's shape: its own code passes through.
        (400, OPENAI_TOO_LONG, UpstreamError(400, "context_length_exceeded",
         "This model's maximum context length is 8192 tokens.")),
        # Ollama, native and OpenAI-compatible: a model not pulled.
        (404, b'{"error":"model \\"llama3.2\\" not found, try pulling it first"}',
         UpstreamError(404, "model_not_found",
                       'model "llama3.2" not found, try pulling it first')),
        (404, (FIXTURES / "ollama-missing.404.json").read_bytes(),
         UpstreamError(404, "model_not_found",
                       'model "llama3.2" not found, try pulling it first')),
        (404, VLLM_NO_MODEL,
         UpstreamError(404, "model_not_found", "The model `gpt-x` does not exist.")),
        # Ollama: a bad request, a plain string.
        (400, b'{"error":"invalid options: foo"}', UpstreamError(400, "", "invalid options: foo")),
        # FastAPI's validation error, and a proxy's page: refusals with their text.
        (422, b'{"detail":[{"loc":["body","n"]}]}',
         UpstreamError(422, "", '[{"loc": ["body", "n"]}]')),
        (413, b"<html>413 Request Entity Too Large</html>",
         UpstreamError(413, "", "<html>413 Request Entity Too Large</html>")),
        # 429: overloaded, its code kept.
        (429, b'{"error":{"message":"Too many requests","code":"rate_limit_exceeded"}}',
         UpstreamError(429, "rate_limit_exceeded", "Too many requests")),
        # A 404 not about a model: a wrong path (the node's setup), a failure.
        (404, b'{"detail":"Not Found"}', UpstreamError(0, "upstream returned 404: Not Found")),
        (404, b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}',
         UpstreamError(0, "upstream returned 404: File Not Found")),
        # The node's own key, a wrong method: failures without a status.
        (401, b'{"error":"unauthorized"}', UpstreamError(0, "upstream returned 401: unauthorized")),
        (405, b"", UpstreamError(0, "upstream returned 405: Method Not Allowed")),
        # Timeouts and server errors: failures with their status.
        (408, b"", UpstreamError(408, "upstream returned 408: Method Not Allowed")),
        (503, (FIXTURES / "llamacpp-loading.503.json").read_bytes(),
         UpstreamError(503, "upstream returned 503: Loading model")),
        (500, b"{", UpstreamError(500, "upstream returned 500: {")),
    ],
)  # fmt: skip
def test_upstream_errors_by_dialect(status: int, raw: bytes, expected: UpstreamError) -> None:
    """Each server's error answer stands for what its status and body say: 400, 413, 422
    and a 404 about the model are refusals with the server's words and code (context
    length recognised in vLLM's words and llama.cpp's type); 429 an overload; 408 and
    5xx failures with their status; any other status a failure with none."""
    assert upstream_error(status, raw, "Method Not Allowed") == expected


def test_upstream_error_is_bounded_and_never_raises() -> None:
    """A huge message is cut, a code that is no short token is dropped, and bodies that
    are not JSON objects (nested past the parser's depth, a list) are quoted as text."""
    huge = b'{"error":{"message":"' + b"x" * 100_000 + b'","code":"' + b"c" * 100 + b'"}}'
    refusal = upstream_error(400, huge)
    assert refusal.error == ""
    assert len(refusal.message) == MAX_ERROR_CHARS + 3
    deep = upstream_error(400, b"[" * 16384)
    assert (deep.http_status, deep.message) == (400, "[" * MAX_ERROR_CHARS + "...")
    assert upstream_error(400, b"[1, 2]") == UpstreamError(400, "", "[1, 2]")
    assert upstream_error(400, b"") == UpstreamError(400, "", "no details")
