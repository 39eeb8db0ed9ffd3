"""Tests of iop-node's reading of error bodies and model lists (`edge.nodes.upstream.bodies`)."""

from __future__ import annotations

import json

import pytest

from edge.nodes.upstream.bodies import context_limits_from_body, error_message, models_from_body
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
