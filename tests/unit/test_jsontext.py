"""The strict JSON decoder of the tool-text scans: one depth rule, whatever the caller's stack.

Invariant: a value's verdict (decoded or ValueError) depends on the text alone,
never on how deep in the stack the decoder was called, so the streaming filter
and the final parse always agree on a deeply nested block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from edge.stream.jsontext import MAX_DEPTH, loads, raw_decode


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _at_stack_depth(frames: int, call: Callable[[], Any]) -> Any:
    """`call()` run `frames` Python frames deeper than here."""
    if frames == 0:
        return call()
    return _at_stack_depth(frames - 1, call)


def _verdict(text: str) -> str:
    try:
        loads(text)
    except ValueError:
        return "refused"
    return "decoded"


def test_depth_up_to_the_limit_decodes_and_one_more_is_refused() -> None:
    assert loads(_nested(MAX_DEPTH)) is not None
    with pytest.raises(ValueError, match="nested too deeply"):
        loads(_nested(MAX_DEPTH + 1))
    with pytest.raises(ValueError, match="nested too deeply"):
        raw_decode('{"a": ' + _nested(MAX_DEPTH) + "} tail", 0)
    value, end = raw_decode('{"a": ' + _nested(MAX_DEPTH - 1) + "} tail", 0)
    assert end == len('{"a": ' + _nested(MAX_DEPTH - 1) + "}")
    assert isinstance(value, dict)


@pytest.mark.parametrize("depth", [MAX_DEPTH, MAX_DEPTH + 1, 600, 2000, 50_000])
def test_the_verdict_does_not_depend_on_the_callers_stack(depth: int) -> None:
    text = _nested(depth)
    shallow = _verdict(text)
    deep = _at_stack_depth(300, lambda: _verdict(text))
    assert shallow == deep == ("decoded" if depth <= MAX_DEPTH else "refused")
