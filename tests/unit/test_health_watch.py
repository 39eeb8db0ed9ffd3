"""A watched node's health (edge.fleet.health): reports, broken streams and silence, on
plain numbers for a clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.fleet.health import (
    SILENCE_HEARTBEATS,
    SILENCE_MIN_S,
    HealthPolicy,
    NodeHealth,
    silence_bound,
)

POLICY = HealthPolicy(breaker_failures=3, cooldown_s=5.0, refresh_s=5.0)


def test_the_silence_bound_is_three_heartbeats_and_at_least_a_second() -> None:
    """A heartbeat of 2 s allows 6 s of silence; one of 0.1 s still 1 s."""
    assert SILENCE_HEARTBEATS == 3
    assert SILENCE_MIN_S == 1.0
    assert silence_bound(2.0) == 6.0
    assert silence_bound(0.1) == 1.0


def test_the_first_report_brings_a_node_up_and_sets_when_the_next_is_due() -> None:
    """A subscription's first report is due within the bound of the heartbeat asked; a
    report brings the node up (True) as a Describe answer would, and the next is due
    within the bound of the heartbeat the node keeps."""
    health = NodeHealth(POLICY)
    health.subscribed(10.0, 0.2)
    assert health.silent_at == 11.0
    assert health.silent_at > 10.9  # the feed's deadline for that report
    assert health.reported(10.5, 2.0)
    assert health.state(10.5) == "up"
    assert health.silent_at == 16.5
    assert not health.reported(11.0, 2.0)  # already up
    assert health.silent_at <= 17.0


def test_a_broken_stream_is_a_failed_describe_suspect_then_down() -> None:
    """The stream breaks: suspect at once (still up), its next subscription within the first
    probe delay; that subscription failing too takes the node down; the silence bound is
    off while no subscription is open."""
    health = NodeHealth(POLICY)
    health.subscribed(0.0, 2.0)
    health.reported(0.0, 2.0)
    assert not health.watch_failed(1.0, "stream broke")
    assert health.state(1.0) == "up"
    assert health.silent_at == math.inf
    assert health.next_check == 1.0 + POLICY.probe_first_s
    health.subscribed(health.next_check, 2.0)
    assert health.watch_failed(health.next_check, "connection refused")
    assert health.state(2.0) == "down"
    assert health.reason == "connection refused"


def test_a_silent_node_goes_down_and_comes_back_with_its_next_report() -> None:
    """Silent past its bound: a failure; a new subscription silent too: down, probed with
    the doubling backoff; its next report brings it up with its backoff reset."""
    health = NodeHealth(POLICY)
    health.subscribed(0.0, 0.2)
    health.reported(0.0, 0.2)
    now = health.silent_at
    assert now == silence_bound(0.2)
    assert not health.watch_failed(now, "silent")
    health.subscribed(health.next_check, 0.2)
    now = health.silent_at
    assert health.watch_failed(now, "silent")
    assert health.state(now) == "down"
    gap = health.next_check - now
    assert gap == pytest.approx(0.5)  # the second probe's delay
    health.subscribed(health.next_check, 0.2)
    assert health.reported(health.next_check + 0.01, 0.2)
    assert health.state(health.next_check) == "up"


@given(
    events=st.lists(
        st.tuples(st.sampled_from(["report", "failed", "subscribe"]), st.floats(0.0, 5.0)),
        max_size=40,
    ),
    heartbeat=st.floats(0.05, 60.0),
)
def test_a_report_always_leaves_the_node_up_and_a_bound_ahead(
    events: list[tuple[str, float]], heartbeat: float
) -> None:
    """Whatever came before, a report leaves the node up with its next report due in the
    future, within the silence bound; a failure leaves no bound and a check in the future."""
    health = NodeHealth(POLICY)
    now = 0.0
    for kind, step in events:
        now += step
        if kind == "report":
            health.reported(now, heartbeat)
            assert health.up
            assert health.silent_at == now + silence_bound(heartbeat)
            assert health.silent_at > now
        elif kind == "failed":
            health.watch_failed(now, "x")
            assert health.silent_at == math.inf
            assert health.next_check > now
        else:
            health.subscribed(now, heartbeat)
            assert now < health.silent_at <= now + silence_bound(heartbeat)
