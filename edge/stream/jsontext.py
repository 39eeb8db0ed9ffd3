"""The strict JSON decoder every tool-text scan uses: one definition of "valid JSON".

It owns the decoder settings (NaN and Infinity rejected, raw control characters in
strings rejected) and turns every failure, a too deep nesting included, into
`ValueError`: model output must never raise anything else. The decoder is the
standard library's C scanner, so decoding is linear in the text and runs at C
speed. It knows nothing of tool calls.

Depth is one fixed rule, `MAX_DEPTH`, checked on the decoded value: the C
scanner's own limit is the interpreter's recursion limit minus the caller's
stack depth, so without it the streaming filter and the final parse (called
from different depths) could judge one deeply nested block differently.
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
# Containers nested deeper than this are not JSON a tool call is read from; far
# below where the C scanner gives up from any caller (about 900 levels).
MAX_DEPTH = 128


def _check_depth(value: Any) -> Any:
    """`value`, or ValueError when containers nest past MAX_DEPTH (iterative: no recursion)."""
    if not isinstance(value, dict | list):
        return value
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError("JSON nested too deeply")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return value


def loads(text: str) -> Any:
    """Strict `json.loads`: NaN/Infinity rejected. Raises ValueError, also for JSON
    nested past the parser's depth."""
    try:
        return _check_depth(_DECODER.decode(text))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def raw_decode(text: str, pos: int) -> tuple[Any, int]:
    """One JSON value starting at `pos` (no whitespace skipped): (value, end).

    Raises `JSONDecodeError` (a ValueError with the position where decoding
    failed) or ValueError (a constant, or nesting too deep).
    """
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    return _check_depth(value), end
