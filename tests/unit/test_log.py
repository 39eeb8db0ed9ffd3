"""Text-log escaping: no client string can put a control character into a log line."""

from __future__ import annotations

import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from edge.log import escape_controls


def test_known_escapes() -> None:
    assert escape_controls("GET /a\nFORGED\x1b[2J\r\t") == "GET /a\\nFORGED\\x1b[2J\\r\\t"
    assert escape_controls("\x85\u2028\u2029\u202e\u2066") == "\\x85\\u2028\\u2029\\u202e\\u2066"
    assert escape_controls("plain text, é, 日本") == "plain text, é, 日本"


@given(st.text())
def test_escaped_text_has_no_control_character(text: str) -> None:
    """Whatever the input, the output is one line with no C0/C1 control, no line or
    paragraph separator and no bidi override; text without those is unchanged."""
    escaped = escape_controls(text)
    assert len(escaped.splitlines()) <= 1
    assert all(_safe(char) for char in escaped)
    if all(_safe(char) for char in text):
        assert escaped == text


def _safe(char: str) -> bool:
    return unicodedata.category(char) != "Cc" and char not in _SEPARATORS_AND_BIDI


_SEPARATORS_AND_BIDI = "\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
