"""A node's health state machine (edge.fleet.health), on plain numbers for a clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.fleet.health import DOWN_AFTER_FAILURES, HealthPolicy, NodeHealth

POLICY = HealthPolicy(breaker_failures=3, cooldown_s=5.0, refresh_s=5.0)


def up_node(now: float = 0.0, policy: HealthPolicy = POLICY) -> NodeHealth:
    health = NodeHealth(policy)
    assert health.describe_ok(now)
    return health


def test_a_new_node_is_down_until_it_answers_and_is_asked_at_once() -> None:
    """Before its first Describe answer a node is down, and due for a Describe now."""
    health = NodeHealth(POLICY)
    assert health.state(0.0) == "down"
    assert not health.admits(0.0)
    assert health.next_check <= 0.0
    assert health.describe_ok(0.0)
    assert health.state(0.0) == "up"
    assert health.next_check == POLICY.refresh_s


def test_one_describe_failure_makes_a_node_suspect_two_take_it_down() -> None:
    """A node that answered before stays routed after one Describe failure, is asked again
    within the first probe delay, and goes down on the second failure in a row."""
    health = up_node()
    assert not health.describe_failed(1.0, "slow")
    assert health.state(1.0) == "up"
    assert health.next_check == 1.0 + POLICY.probe_first_s
    assert DOWN_AFTER_FAILURES == 2
    assert health.describe_failed(health.next_check, "refused")
    assert health.state(2.0) == "down"
    assert health.reason == "refused"


def test_a_down_node_is_probed_with_doubling_backoff_capped() -> None:
    """Probes of a down node come 0.25 s, 0.5 s, then every PROBE_MAX_S (1 s) apart, and
    never further apart than the refresh interval."""
    health = NodeHealth(POLICY)
    now, gaps = 0.0, []
    for _ in range(6):
        health.describe_failed(now, "refused")
        gaps.append(health.next_check - now)
        now = health.next_check
    assert gaps == pytest.approx([0.25, 0.5, 1.0, 1.0, 1.0, 1.0])
    fast = NodeHealth(HealthPolicy(refresh_s=0.4))
    now, gaps = 0.0, []
    for _ in range(4):
        fast.describe_failed(now, "refused")
        gaps.append(fast.next_check - now)
        now = fast.next_check
    assert gaps == pytest.approx([0.25, 0.4, 0.4, 0.4])


def test_a_refused_run_takes_the_node_down_at_once_and_brings_its_probe_forward() -> None:
    """mark_down: down now, its next Describe within the first probe delay (not the
    refresh interval); a second refusal changes nothing more."""
    health = up_node()
    assert health.mark_down(2.0, "connection refused")
    assert health.state(2.0) == "down"
    assert health.next_check == 2.0 + POLICY.probe_first_s
    assert not health.mark_down(2.1, "connection refused")
    assert health.next_check == 2.0 + POLICY.probe_first_s
    assert health.describe_ok(2.25)
    assert health.state(2.25) == "up"
    assert health.next_check == 2.25 + POLICY.refresh_s


def test_the_breaker_opens_after_n_failures_in_a_row_and_half_opens_after_the_cooldown() -> None:
    """breaker_failures failed runs in a row open the breaker (a success in between resets
    the count); cooldown_s later exactly one probe run may start."""
    health = up_node()
    assert not health.run_failed(1.0)
    assert not health.run_failed(1.1)
    health.run_succeeded(1.2)
    assert not health.run_failed(1.3)
    assert not health.run_failed(1.4)
    assert health.run_failed(1.5)
    assert health.state(1.5) == "open"
    assert not health.admits(1.5)
    assert health.wake_at(describing=True) == 6.5
    assert health.state(6.4) == "open"
    assert health.state(6.5) == "half_open"
    assert health.admits(6.5)
    health.breaker.take(6.5, POLICY.cooldown_s)
    assert not health.admits(6.6)  # the one probe is out
    assert health.state(6.6) == "half_open"


def test_the_probe_run_decides() -> None:
    """Half-open: the probe's success closes the breaker; its failure opens it again for
    a whole cooldown."""
    health = up_node()
    for i in range(3):
        health.run_failed(float(i))
    health.breaker.take(7.0, POLICY.cooldown_s)
    assert health.run_failed(7.5)
    assert health.state(7.5) == "open"
    assert health.state(12.4) == "open"
    assert health.admits(12.5)
    health.breaker.take(12.5, POLICY.cooldown_s)
    assert health.run_succeeded(12.6)
    assert health.state(12.6) == "up"
    assert health.breaker.failures == 0
    assert health.admits(12.6)


def test_a_refused_run_counts_neither_way_and_frees_the_probe_at_once() -> None:
    """A run the node refused (4xx) or was too busy for (429) is neither a success nor a
    failure: the count of failures in a row stands, the breaker does not move; a
    half-open probe so answered is free again at once (not after a cooldown), and the
    next run is the probe."""
    health = up_node()
    health.run_failed(1.0)
    health.run_failed(2.0)
    assert not health.run_refused(2.5)
    assert (health.breaker.failures, health.state(2.5)) == (2, "up")
    assert health.run_failed(3.0)  # the third in a row: the refusal did not reset the count
    health.breaker.take(8.0, POLICY.cooldown_s)
    assert not health.admits(8.1)
    assert health.run_refused(8.1)
    assert health.state(8.1) == "half_open"
    assert health.admits(8.1)
    assert health.wake_at(describing=True) == math.inf
    health.breaker.take(8.2, POLICY.cooldown_s)
    assert health.run_succeeded(8.3)
    assert health.state(8.3) == "up"


def test_advance_half_opens_on_time_and_says_so_once() -> None:
    """The pool's background task learns of the half-opening from `advance` (once), and
    a probe whose verdict never came is freed after another cooldown."""
    health = up_node()
    for i in range(3):
        health.run_failed(float(i))
    assert not health.advance(6.9)
    assert health.advance(7.0)
    assert not health.advance(7.0)
    health.breaker.take(7.0, POLICY.cooldown_s)
    assert health.wake_at(describing=True) == 12.0
    assert not health.advance(11.9)
    assert health.advance(12.0)
    assert health.admits(12.0)


def test_a_node_back_from_down_with_an_open_breaker_has_it_closed() -> None:
    """The failures of a process that died say nothing of its restart: the node that
    answers Describe again takes runs at once, its breaker closed and its count reset
    (failures of its own open it again)."""
    health = up_node()
    for i in range(3):
        health.run_failed(float(i))
    assert health.state(2.0) == "open"
    health.mark_down(2.0, "refused")
    assert health.state(2.1) == "down"
    assert health.describe_ok(2.5)
    assert health.state(2.5) == "up"
    assert health.admits(2.5)
    assert health.breaker.failures == 0


def test_a_run_that_succeeds_on_a_down_node_brings_it_up() -> None:
    """Panic routing sent a run to a node marked down and it worked: the node is up and
    asked for its models at once."""
    health = up_node()
    health.mark_down(1.0, "refused")
    assert health.run_succeeded(1.1)
    assert health.state(1.1) == "up"
    assert health.next_check == 1.1


def test_breaker_state_does_not_matter_while_down() -> None:
    """Down wins over the breaker in the state shown; an open breaker still runs its
    cooldown meanwhile."""
    health = up_node()
    for i in range(3):
        health.run_failed(float(i))
    health.describe_failed(3.0, "x")
    health.describe_failed(3.25, "x")
    assert health.state(3.3) == "down"
    assert health.state(100.0) == "down"
    assert not health.admits(100.0)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["ok", "fail", "down", "run_ok", "run_fail", "refused", "take", "advance"]
            ),
            st.floats(min_value=0.0, max_value=3.0),
        ),
        max_size=60,
    )
)
def test_any_sequence_keeps_the_invariants(steps: list[tuple[str, float]]) -> None:
    """Whatever happens, in time order: the state is one of four; a down node admits no
    run; an open breaker admits none before its cooldown; the next Describe of a down
    node is never further than the probe cap away; the wake time is never in the past
    of the last input by more than the schedule allows (it is finite once contacted)."""
    health = NodeHealth(POLICY)
    now = 0.0
    for action, step in steps:
        now += step
        if action == "ok":
            health.describe_ok(now)
        elif action == "fail":
            health.describe_failed(now, "x")
        elif action == "down":
            health.mark_down(now, "x")
        elif action == "run_ok":
            health.run_succeeded(now)
        elif action == "run_fail":
            health.run_failed(now)
        elif action == "refused":
            health.run_refused(now)
        elif action == "take" and health.admits(now):
            health.breaker.take(now, POLICY.cooldown_s)
        else:
            health.advance(now)
        state = health.state(now)
        assert state in ("up", "down", "open", "half_open")
        if state in ("down", "open"):
            assert not health.admits(now)
        if state == "up":
            assert health.admits(now)
        if action in ("fail", "down") and state == "down":
            assert health.next_check <= now + POLICY.probe_cap_s
        assert not math.isnan(health.wake_at(describing=False))


@pytest.mark.parametrize("failures", [1, 2, 5])
def test_breaker_failures_is_the_threshold(failures: int) -> None:
    """Exactly `breaker_failures` failures in a row open the breaker, not one fewer."""
    health = up_node(policy=HealthPolicy(breaker_failures=failures))
    for i in range(failures - 1):
        assert not health.run_failed(float(i))
    assert health.run_failed(float(failures))
