"""The strict JSON decoder every tool-text scan uses: one definition of "valid JSON".

It owns the decoder settings (NaN and Infinity rejected, raw control characters in
strings rejected) and turns every failure, a too deep nesting included, into
`ValueError`: model output must never raise anything else. The decoder is the
standard library's C scanner, so decoding is linear in the text and runs at C
speed. It knows nothing of tool calls.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JSONDecodeError", "loads", "raw_decode"]

JSONDecodeError = json.JSONDecodeError


def _no_constants(token: str) -> Any:
    # NaN and Infinity are not JSON; json would accept them and dumps would emit them.
    raise ValueError(f"{token} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def loads(text: str) -> Any:
    """Strict `json.loads`: NaN/Infinity rejected. Raises ValueError, also for JSON
    nested past the parser's depth."""
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def raw_decode(text: str, pos: int) -> tuple[Any, int]:
    """One JSON value starting at `pos` (no whitespace skipped): (value, end).

    Raises `JSONDecodeError` (a ValueError with the position where decoding
    failed) or ValueError (a constant, or nesting too deep).
    """
    try:
        return _DECODER.raw_decode(text, pos)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
