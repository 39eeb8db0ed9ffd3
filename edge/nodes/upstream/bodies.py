"""What an upstream answers besides its stream: an error body, a model list.

`error_message` digs the message out of any server's error body (quoted,
bounded); `models_from_body` reads the ids of a `/models` answer in
OpenAI's, llama.cpp's or Ollama's shape, and `context_limits_from_body` the
models' context lengths where it gives them (vLLM's and SGLang's `max_model_len`).

Pure: it must not know sockets, httpx, grpclib or asyncio.
"""

from __future__ import annotations

import json
from typing import Final, cast

__all__ = ["MAX_ERROR_CHARS", "context_limits_from_body", "error_message", "models_from_body"]

# Error bodies are quoted up to this many characters.
MAX_ERROR_CHARS: Final = 500
# The largest context length taken from a model list (ModelInfo.max_context_tokens is a uint32).
MAX_CONTEXT_TOKENS: Final = 2**32 - 1


def error_message(status: int, body: bytes, reason: str = "") -> str:
    """`upstream returned STATUS: MESSAGE`, the message dug out of any server's error body.

    Shapes: `{"error": {"message"}}` (OpenAI, llama.cpp, Ollama),
    `{"error": "..."}`, `{"object": "error", "message"}` (vLLM, SGLang),
    `{"detail": ...}` (FastAPI), or plain text.
    """
    text = body.decode("utf-8", errors="replace").strip()
    message = ""
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict) and error.get("message"):
            message = str(error["message"])
        elif isinstance(error, str) and error:
            message = error
        elif doc.get("message"):
            message = str(doc["message"])
        elif doc.get("detail"):
            detail = doc["detail"]
            message = detail if isinstance(detail, str) else json.dumps(detail)
    if not message:
        message = text or reason or "no details"
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    return f"upstream returned {status}: {message}"


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
