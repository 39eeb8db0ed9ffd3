"""The limits' pure logic (edge.limits.window), the key ring, the in-process store,
the limiter's leases (renewals, retried releases, refunds; an in-process store that
fails on demand) and the `[[keys]]` / `[limits]` config."""

from __future__ import annotations

import hmac
from collections.abc import Collection, Mapping
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from edge.config import ConfigError, KeyConfig, parse_config
from edge.errors import NotFoundError
from edge.limits.base import StoreUnavailable
from edge.limits.limiter import LEGACY_NAME, Gate, Key, KeyRing, Limiter, legacy_name
from edge.limits.memory import MemoryStore
from edge.limits.window import (
    WINDOW_MS,
    Decision,
    Limits,
    Window,
    add_tokens,
    admit,
    duration_text,
    rate_headers,
    refund,
    retry_after_s,
)
from edge.observe.metrics import EdgeMetrics


def test_the_request_past_rpm_is_refused_and_not_counted() -> None:
    """rpm = 10: ten requests in a window pass, the 11th is refused, and refusals are not
    counted (the window still holds ten)."""
    window, limits = Window(), Limits(rpm=10)
    decisions = [admit(window, 0, limits, 1000 + i) for i in range(12)]
    assert [d.admitted for d in decisions] == [True] * 10 + [False, False]
    assert decisions[10].over == "requests"
    assert window.requests == 10
    assert decisions[10].reset_ms == WINDOW_MS - 10


def test_the_window_is_anchored_on_its_first_request_and_starts_afresh() -> None:
    """The window starts at the first request, lasts WINDOW_MS, then counts from zero."""
    window, limits = Window(), Limits(rpm=1)
    assert admit(window, 0, limits, 5_000).admitted
    assert not admit(window, 0, limits, 5_000 + WINDOW_MS - 1).admitted
    again = admit(window, 0, limits, 5_000 + WINDOW_MS)
    assert again.admitted
    assert again.reset_ms == WINDOW_MS


def test_tokens_counted_at_the_end_refuse_the_next_request_until_the_reset() -> None:
    """A window at or past tpm refuses; tokens land in the window they ended in."""
    window, limits = Window(), Limits(tpm=100)
    assert admit(window, 0, limits, 0).admitted
    add_tokens(window, 60, 10)
    assert admit(window, 0, limits, 20).admitted
    add_tokens(window, 60, 30)
    refused = admit(window, 0, limits, 40)
    assert (refused.over, refused.tokens) == ("tokens", 120)
    add_tokens(window, 5, WINDOW_MS + 1)  # a new window: only these tokens
    assert window.tokens == 5


def test_streams_at_max_are_refused() -> None:
    window, limits = Window(), Limits(max_streams=2)
    assert admit(window, 1, limits, 0).streams == 2
    assert admit(window, 2, limits, 0).over == "streams"


@given(
    st.integers(1, 20),
    st.lists(st.tuples(st.integers(0, 3 * WINDOW_MS), st.integers(0, 50)), max_size=80),
)
def test_no_window_admits_more_than_rpm(rpm: int, steps: list[tuple[int, int]]) -> None:
    """Whatever the arrival times and tokens, each window admits at most rpm requests,
    and a refusal names a limit that is reached."""
    window, limits = Window(), Limits(rpm=rpm, tpm=200)
    admitted: dict[int, int] = {}
    now = 0
    for gap, tokens in steps:
        now += gap % 5000
        d = admit(window, 0, limits, now)
        if d.admitted:
            admitted[window.start_ms] = admitted.get(window.start_ms, 0) + 1
            add_tokens(window, tokens, now)
        else:
            assert d.requests >= rpm or d.tokens >= 200
    assert all(n <= rpm for n in admitted.values())


@pytest.mark.parametrize(
    ("ms", "text"),
    [(0, "0ms"), (250, "250ms"), (1000, "1s"), (1500, "1.5s"), (59_999, "59.999s"),
     (60_000, "1m0s"), (90_500, "1m30.5s"), (360_000, "6m0s")],
)  # fmt: skip
def test_resets_are_written_as_openai_writes_them(ms: int, text: str) -> None:
    assert duration_text(ms) == text


def test_headers_and_retry_after() -> None:
    """Headers only for the limits a key has; Retry-After rounds the reset up."""
    d = Decision(None, 3, 40, 1, 1500)
    assert rate_headers(Limits(rpm=10, tpm=100), d) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "7",
        "x-ratelimit-reset-requests": "1.5s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "60",
        "x-ratelimit-reset-tokens": "1.5s",
    }
    assert rate_headers(Limits(max_streams=1), d) == {}
    assert retry_after_s(Decision("requests", 10, 0, 0, 1500)) == 2
    assert retry_after_s(Decision("requests", 10, 0, 0, 0)) == 1
    assert retry_after_s(Decision("streams", 1, 0, 1, 30_000)) == 1


def test_key_ring_identifies_keys_by_a_constant_time_compare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every lookup, hit or miss, goes through hmac.compare_digest; the scheme is
    case-insensitive, the key exact; keys of [server] api_keys have no limits."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    ring = KeyRing([KeyConfig("team-a", "sk-a", rpm=5, models=("m1",))], ["sk-old"])
    key = ring.identify("bearer sk-a")
    assert key is not None
    assert (key.name, key.limits.rpm, key.allows("m1"), key.allows("m2")) == (
        "team-a", 5, True, False,
    )  # fmt: skip
    legacy = ring.identify("Bearer sk-old")
    assert legacy is not None
    assert (legacy.name, legacy.limited) == (legacy_name("sk-old"), False)
    assert legacy.name.startswith(f"{LEGACY_NAME}-")
    assert "sk-old" not in legacy.name
    assert ring.identify("Bearer sk-A") is None
    assert ring.identify("Basic sk-a") is None
    assert ring.identify(None) is None
    assert len(calls) == 3  # the three bearer lookups, the miss included
    assert all(len(a) == len(b) == 32 for a, b in calls)


async def test_memory_store_counts_streams_by_lease() -> None:
    """A stream is held from admit to release; a second release of one lease is a no-op."""
    now = [0]
    store = MemoryStore(clock=lambda: now[0])
    limits = Limits(max_streams=1)
    assert (await store.admit("k", limits, "a")).admitted
    assert (await store.admit("k", limits, "b")).over == "streams"
    await store.release("k", "a")
    await store.release("k", "a")
    assert (await store.admit("k", limits, "c")).admitted


def _keys_config(tmp_path: Path, body: str) -> object:
    path = tmp_path / "edge.toml"
    path.write_text(body)
    from edge.config import load_config

    return load_config(path)


def test_keys_come_from_key_key_env_or_key_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each [[keys]] entry takes its secret from exactly one place; the secret never
    shows in the config's repr."""
    monkeypatch.setenv("TEAM_B_KEY", "sk-from-env")
    (tmp_path / "c.key").write_text("sk-from-file\n")
    config = _keys_config(
        tmp_path,
        """
[[keys]]
name = "a"
key = "sk-inline"
rpm = 10
tpm = 1000
max_streams = 2
models = ["sim-echo"]

[[keys]]
name = "b"
key_env = "TEAM_B_KEY"

[[keys]]
name = "c"
key_file = "c.key"

[limits]
redis_url = "redis://127.0.0.1:6379/0"
fail_open = false
key_prefix = "edge:"
""",
    )
    keys = config.keys  # type: ignore[attr-defined]
    assert [(k.name, k.secret) for k in keys] == [
        ("a", "sk-inline"), ("b", "sk-from-env"), ("c", "sk-from-file"),
    ]  # fmt: skip
    assert (keys[0].rpm, keys[0].tpm, keys[0].max_streams, keys[0].models) == (
        10, 1000, 2, ("sim-echo",),
    )  # fmt: skip
    assert keys[1].limited is False
    assert "sk-" not in repr(config)
    limits = config.limits  # type: ignore[attr-defined]
    assert (limits.redis_url, limits.fail_open, limits.key_prefix) == (
        "redis://127.0.0.1:6379/0", False, "edge:",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('name = "a"', "give exactly one of key, key_env, key_file"),
        ('name = "a"\nkey = "x"\nkey_env = "Y"', "give exactly one"),
        ('key = "x"', "keys[0].name: missing"),
        ('name = "a b"\nkey = "x"', "keys[0].name: expected"),
        ('name = "a"\nkey_env = "IOP_TEST_UNSET_VAR"', "'IOP_TEST_UNSET_VAR' is not set"),
        ('name = "a"\nkey_file = "missing.key"', "cannot read missing.key"),
        ('name = "a"\nkey = "x"\nrpm = 0', "keys[0].rpm: must be between 1"),
        ('name = "a"\nkey = "x"\nburst = 3', "unknown key keys[0].burst"),
        ('name = "api_keys"\nkey = "x"', "keys[0].name: names starting 'api_keys' are"),
        ('name = "api_keys-1"\nkey = "x"', "keys[0].name: names starting 'api_keys' are"),
    ],
)
def test_key_mistakes_are_one_line_naming_the_setting(entry: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config({"keys": [dict(_toml_pairs(entry))]}, "edge.toml")


def _toml_pairs(entry: str) -> list[tuple[str, object]]:
    import tomllib

    return list(tomllib.loads(entry).items())


def test_duplicate_names_and_secrets_are_refused() -> None:
    with pytest.raises(ConfigError, match="duplicate key name 'a'"):
        parse_config({"keys": [{"name": "a", "key": "x"}, {"name": "a", "key": "y"}]}, "e")
    with pytest.raises(ConfigError, match="the same key is configured twice") as info:
        parse_config({"keys": [{"name": "a", "key": "x1"}, {"name": "b", "key": "x1"}]}, "e")
    assert "x1" not in str(info.value)
    with pytest.raises(ConfigError, match=r"limits\.redis_url"):
        parse_config({"limits": {"redis_url": "http://x"}}, "e")


def test_lease_settings_are_read_and_checked() -> None:
    """[limits] lease_s and lease_renew_s: defaults 10 s and 3 s; a renewal period over
    half the lease (a late renewal would let a live stream expire) is refused."""
    default = parse_config({}, "e").limits
    assert (default.lease_s, default.lease_renew_s) == (10.0, 3.0)
    set_ = parse_config({"limits": {"lease_s": 4, "lease_renew_s": 1}}, "e").limits
    assert (set_.lease_s, set_.lease_renew_s) == (4.0, 1.0)
    with pytest.raises(ConfigError, match=r"limits\.lease_renew_s: must be at most half"):
        parse_config({"limits": {"lease_s": 4, "lease_renew_s": 3}}, "e")


def test_a_refund_takes_back_one_request_of_the_running_window_only() -> None:
    """A refunded request is no longer counted in its window; a window that ended (or
    none) is left alone."""
    window, limits = Window(), Limits(rpm=2)
    assert admit(window, 0, limits, 0).admitted
    assert admit(window, 0, limits, 1).admitted
    refund(window, 2)
    assert admit(window, 0, limits, 3).admitted
    refund(window, WINDOW_MS + 5)  # the window is over: nothing to take back
    assert window.requests == 2
    empty = Window()
    refund(empty, 0)
    assert (empty.start_ms, empty.requests) == (-1, 0)


class _FlakyStore(MemoryStore):
    """The in-process store with releases that fail `failures` times, and counted calls."""

    kind = "flaky"

    def __init__(self, failures: int = 0) -> None:
        super().__init__()
        self.failures = failures
        self.releases: list[str] = []
        self.renewals: list[dict[str, frozenset[str]]] = []

    async def release(self, key: str, lease: str) -> None:
        await trio.lowlevel.checkpoint()
        if self.failures > 0:
            self.failures -= 1
            raise StoreUnavailable("down")
        self.releases.append(lease)
        await super().release(key, lease)

    async def renew(self, leases: Mapping[str, Collection[str]]) -> None:
        await trio.lowlevel.checkpoint()
        self.renewals.append({k: frozenset(v) for k, v in leases.items()})


def _gate(limiter: Limiter, key: Key) -> Gate:
    gate = Gate(limiter, limiter.metrics)
    gate.key = key
    return gate


async def test_a_failed_release_is_retried_in_the_background(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A release the store did not take does not hold the request: its end returns, and
    the stream is given back by a later retry (here the third attempt)."""
    store = _FlakyStore(failures=2)
    limiter = Limiter(store, fail_open=True, metrics=EdgeMetrics())
    key = Key("k", Limits(max_streams=1))
    gate = _gate(limiter, key)
    await gate.admit()
    await gate.check_model("m")
    began = trio.current_time()
    await gate.end(None)
    assert trio.current_time() - began < 1.0  # never waits for the retries
    assert store.releases == []
    with trio.fail_after(60):
        while not store.releases:  # noqa: ASYNC110 - the retrier's own clock (autojump)
            await trio.sleep(0.1)
    assert len(store.releases) == 1
    assert (await store.admit("k", key.limits, "next")).admitted


async def test_a_release_that_keeps_failing_is_given_up_after_a_few_rounds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The retries are bounded: a few rounds with backoff, then the lease is left to
    expire (no task keeps trying)."""
    store = _FlakyStore(failures=1_000)
    limiter = Limiter(store, fail_open=True, metrics=EdgeMetrics())
    gate = _gate(limiter, Key("k", Limits(max_streams=1)))
    await gate.admit()
    await gate.end(None)
    await trio.sleep(3600)
    assert 1_000 - store.failures == 1 + 5  # the release, then five rounds
    assert limiter._retrier is None


async def test_one_task_renews_every_lease_of_the_process_in_one_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ten requests holding streams: each renewal is one store call naming all ten
    leases, one per period (not one per request, and no task per request); once they
    ended, the key is named once more, empty, with a later request's lease if one came;
    and once nothing is held, nothing is renewed and the renewing task is gone."""
    store = _FlakyStore()
    limiter = Limiter(store, fail_open=True, metrics=EdgeMetrics(), renew_s=3.0)
    key = Key("k", Limits(max_streams=100))
    gates = [_gate(limiter, key) for _ in range(10)]
    for gate in gates:
        await gate.admit()
    await trio.sleep(30.1)  # renewals at 3, 6, ..., 30 s
    assert len(store.renewals) == 10
    assert all(r == {"k": frozenset(g._lease for g in gates)} for r in store.renewals)
    for gate in gates:
        await gate.end(None)
    other = _gate(limiter, key)
    await other.admit()
    await trio.sleep(3.0)
    assert store.renewals[10] == {"k": frozenset({other._lease})}
    await other.end(None)
    await trio.sleep(30)
    assert store.renewals[11:] == [{"k": frozenset()}]  # told once, then nothing
    assert limiter._renewer is None


async def test_a_model_outside_the_allow_list_refunds_the_admission() -> None:
    """Admitted before its body was read, a request for a model the key may not use is
    404 and not counted: the window and the streams are as before it."""
    store = MemoryStore()
    limiter = Limiter(store, fail_open=True, metrics=EdgeMetrics())
    key = Key("k", Limits(rpm=2, max_streams=1), frozenset({"m"}))
    refused = _gate(limiter, key)
    await refused.admit()
    assert refused.headers["x-ratelimit-remaining-requests"] == "1"
    with pytest.raises(NotFoundError):
        await refused.check_model("other")
    assert refused.headers == {}
    await refused.end(None)
    ok = _gate(limiter, key)
    await ok.admit()
    await ok.check_model("m")
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"
