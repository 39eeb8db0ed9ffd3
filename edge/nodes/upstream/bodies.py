"""What an upstream answers besides its stream: an error body, a model list.

`error_message` digs the message out of any server's error body (quoted,
bounded); `upstream_error` says what an error answer of a run stands for
(a refusal, an overload or a failure: the run's error event);
`models_from_body` reads the ids of a `/models` answer in OpenAI's,
llama.cpp's or Ollama's shape, and `context_limits_from_body` the models'
context lengths where it gives them (vLLM's and SGLang's `max_model_len`).

Pure: it must not know sockets, httpx, grpclib or asyncio.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Final, cast

__all__ = [
    "MAX_ERROR_CHARS",
    "UpstreamError",
    "context_limits_from_body",
    "error_message",
    "models_from_body",
    "upstream_error",
]

# Error bodies are quoted up to this many characters.
MAX_ERROR_CHARS: Final = 500
# The largest context length taken from a model list (ModelInfo.max_context_tokens is a uint32).
MAX_CONTEXT_TOKENS: Final = 2**32 - 1
# Statuses of a request the model server refuses (404: only about the model).
_REFUSED: Final = frozenset({400, 404, 413, 422})
# A code or type worth passing on: a short token.
_TOKEN: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
# A prompt past the model's context, in the words of vLLM ("This model's maximum
# context length is ...", "... longer than the maximum model length ..."), SGLang,
# TGI and others, or llama.cpp's error type.
_CONTEXT: Final = re.compile(
    r"context (length|window|size)|maximum model length|prompt is too long|too many tokens",
    re.IGNORECASE,
)
_CONTEXT_TYPES: Final = frozenset({"exceed_context_size_error", "context_length_exceeded"})
# A 404 about the model (not a wrong path): its message names one.
_MODEL: Final = re.compile(r"\bmodel\b", re.IGNORECASE)


def error_message(status: int, body: bytes, reason: str = "") -> str:
    """`upstream returned STATUS: MESSAGE`, the message dug out of any server's error body.

    Shapes: `{"error": {"message"}}` (OpenAI, llama.cpp, Ollama),
    `{"error": "..."}`, `{"object": "error", "message"}` (vLLM, SGLang),
    `{"detail": ...}` (FastAPI), or plain text.
    """
    return f"upstream returned {status}: {_fields(body, reason)[0]}"


@dataclass(frozen=True, slots=True)
class UpstreamError:
    """An upstream's error answer as the run's error event says it (the contract's
    `http_status`, `error`, `message`)."""

    # The status the edge acts on: 4xx (a refusal), 429 (overloaded), 408 or 5xx (a
    # failure); 0 for a failure the status would misname (the node's own setup).
    http_status: int
    # A refusal's machine-readable code ("" if none); a failure's whole text.
    error: str
    # A refusal's words, the model server's own ("" for a failure).
    message: str = ""


def upstream_error(status: int, body: bytes, reason: str = "") -> UpstreamError:
    """What an upstream's error answer (`status` >= 400, `body` read bounded) stands for.

    400, 413 and 422 are refusals: the request is at fault, and the client sees
    the status, the server's message and its code (`context_length_exceeded`
    when the server says the prompt is too long in its own words or type). 404
    is one when it is about the model (OpenAI's and vLLM's `model_not_found`,
    Ollama's "model not found"); any other 404 is a wrong `--upstream` path, the
    node's failure. 429: the server is overloaded. 408 and 5xx are failures, with
    their status; any other status (401 and 403: the node's key; 405: a wrong
    path) is a failure with no status, since the request is not at fault.
    """
    message, code, kind = _fields(body, reason)
    if status == 404 and code != "model_not_found":
        code = "model_not_found" if _MODEL.search(message) else ""
    if status in _REFUSED and (status != 404 or code):
        if status != 404 and not code and (kind in _CONTEXT_TYPES or _CONTEXT.search(message)):
            code = "context_length_exceeded"
        return UpstreamError(status, code, message)
    if status == 429:
        return UpstreamError(429, code, message)
    text = f"upstream returned {status}: {message}"
    return UpstreamError(status if status == 408 or status >= 500 else 0, text)


def _fields(body: bytes, reason: str) -> tuple[str, str, str]:
    """(message, code, type) of any server's error body: the message bounded (never
    empty), the code and type only when they are short tokens (else "")."""
    text = body.decode("utf-8", errors="replace").strip()
    message = code = kind = ""
    try:
        doc = json.loads(text) if text else None
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        doc = None
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict):
            source: dict[str, object] = error
            if error.get("message"):
                message = str(error["message"])
        else:
            source = doc
            if isinstance(error, str) and error:
                message = error
        if not message and doc.get("message"):
            message = str(doc["message"])
        elif not message and doc.get("detail"):
            detail = doc["detail"]
            message = detail if isinstance(detail, str) else json.dumps(detail)
        code, kind = _token(source.get("code")), _token(source.get("type"))
    if not message:
        message = text or reason or "no details"
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    return message, code, kind


def _token(value: object) -> str:
    """`value` when it is a short machine-readable string (a code, a type), else ""."""
    if isinstance(value, str) and _TOKEN.fullmatch(value):
        return value
    return ""


def models_from_body(body: bytes) -> list[tuple[str, str]]:
    """(id, owned_by) of each model in a `/models` answer; raises ValueError if it has none.

    OpenAI's `{"data": [{"id"}]}`, or llama.cpp's and Ollama's `{"models": [{"name"}]}`.
    """
    doc = json.loads(body)
    items: object = None
    if isinstance(doc, dict):
        items = doc.get("data") or doc.get("models")
    if not isinstance(items, list):
        raise ValueError("the /models answer has no model list")
    out: list[tuple[str, str]] = []
    for item in cast(list[object], items):
        if isinstance(item, dict):
            model = item.get("id") or item.get("model") or item.get("name")
            if isinstance(model, str) and model:
                out.append((model, str(item.get("owned_by") or "")))
    return out


def context_limits_from_body(body: bytes) -> dict[str, int]:
    """Each model's context length (tokens) where a `/models` answer gives it.

    vLLM and SGLang put `max_model_len` on each item of OpenAI's `data` list;
    a value that is not a whole number in 1..MAX_CONTEXT_TOKENS is left out,
    as is a body that is not such a list (llama.cpp, Ollama: none is known).
    """
    try:
        doc = json.loads(body)
    except ValueError:
        return {}
    items = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        return {}
    limits: dict[str, int] = {}
    for item in cast(list[object], items):
        if not isinstance(item, dict):
            continue
        model, limit = item.get("id"), item.get("max_model_len")
        if (
            isinstance(model, str)
            and model
            and isinstance(limit, int)
            and not isinstance(limit, bool)
            and 0 < limit <= MAX_CONTEXT_TOKENS
        ):
            limits[model] = limit
    return limits
