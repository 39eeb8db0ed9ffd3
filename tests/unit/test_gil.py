"""The GIL's switch interval is shortened only while a large parse runs (edge.http.gil)."""

from __future__ import annotations

import sys

import pytest

from edge.http.gil import LARGE_BYTES, SHARED_S, GilShare


def test_the_interval_is_short_while_a_large_parse_runs_and_put_back_after() -> None:
    default = sys.getswitchinterval()
    share = GilShare()
    with share.large(LARGE_BYTES - 1):
        assert sys.getswitchinterval() == default  # a small parse changes nothing
    with share.large(LARGE_BYTES):
        assert sys.getswitchinterval() == SHARED_S
        with share.large(10 * LARGE_BYTES):
            assert sys.getswitchinterval() == SHARED_S
        assert sys.getswitchinterval() == SHARED_S  # one still runs
    assert sys.getswitchinterval() == default
    with pytest.raises(ValueError, match="fails"), share.large(LARGE_BYTES):
        raise ValueError("a parse that fails")
    assert sys.getswitchinterval() == default
