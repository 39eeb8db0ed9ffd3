"""Tenants and service tiers in the configuration and as the fleet sees them.

`[[keys]] weight`, `service_tiers` and `service_tier`, `[admission] policy` and
`max_queue_per_key` as the file gives them (and their mistakes, one line naming the
setting); a key as the limits layer knows it; a tenant's tier for what a request asks.
"""

from __future__ import annotations

import pytest

from edge.config import AdmissionConfig, ConfigError, parse_config
from edge.errors import RequestError
from edge.fleet.tenants import DEFAULT_TIERS, Tenant, band
from edge.limits.limiter import KeyRing, legacy_name


def test_keys_carry_a_weight_and_their_service_tiers() -> None:
    """Read as given; left out: weight 1, tiers default and flex, default "default"."""
    config = parse_config(
        {
            "keys": [
                {
                    "name": "gold",
                    "key": "sk-1",
                    "weight": 3,
                    "service_tiers": ["priority", "default"],
                    "service_tier": "priority",
                },
                {"name": "plain", "key": "sk-2"},
            ]
        },
        "edge.toml",
    )
    gold, plain = config.keys
    assert (gold.weight, gold.service_tiers, gold.service_tier) == (
        3.0, ("priority", "default"), "priority",
    )  # fmt: skip
    assert (plain.weight, plain.service_tiers) == (1.0, DEFAULT_TIERS)
    assert plain.service_tier == "default"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"weight": 0}, r"keys\[0\].weight: must be >= 0.01"),
        ({"service_tiers": ["gold"]}, r"keys\[0\].service_tiers: 'gold' is not one of"),
        ({"service_tiers": []}, r"keys\[0\].service_tiers: name at least one tier"),
        ({"service_tier": "auto"}, r"keys\[0\].service_tier: expected one of"),
        (
            {"service_tiers": ["flex"], "service_tier": "default"},
            r"keys\[0\].service_tier: must be one of the key's service_tiers",
        ),
    ],
)
def test_tier_and_weight_mistakes_name_the_setting(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"keys": [{"name": "a", "key": "x", **entry}]}, "edge.toml")


def test_the_admission_policy_and_the_bound_per_key() -> None:
    """fair by default; the bound per key is a quarter of max_queue (at least 1) unless set."""
    assert AdmissionConfig().policy == "fair"
    assert AdmissionConfig().key_max_queue == 250
    assert AdmissionConfig(max_queue=3).key_max_queue == 1
    assert AdmissionConfig(max_queue=3, max_queue_per_key=3).key_max_queue == 3
    config = parse_config(
        {"admission": {"policy": "fifo", "max_queue": 40, "max_queue_per_key": 5}}, "e"
    )
    assert (config.admission.policy, config.admission.key_max_queue) == ("fifo", 5)
    with pytest.raises(ConfigError, match=r"admission\.policy: expected one of"):
        parse_config({"admission": {"policy": "lifo"}}, "e")
    with pytest.raises(ConfigError, match=r"admission\.max_queue_per_key: must be between 1"):
        parse_config({"admission": {"max_queue_per_key": 0}}, "e")


def test_a_key_as_the_limits_know_it() -> None:
    """A `[[keys]]` entry is named (its name may be a label) and carries its weight and
    tiers; a key of `[server] api_keys` is its own tenant, unnamed, with the defaults."""
    config = parse_config(
        {
            "server": {"api_keys": ["sk-legacy"]},
            "keys": [
                {
                    "name": "gold",
                    "key": "sk-1",
                    "weight": 2.5,
                    "service_tiers": ["priority", "default"],
                }
            ],
        },
        "e",
    )
    ring = KeyRing(config.keys, config.server.api_keys)
    gold = ring.identify("Bearer sk-1")
    legacy = ring.identify("Bearer sk-legacy")
    assert gold is not None
    assert legacy is not None
    assert (gold.named, gold.weight, gold.service_tiers) == (True, 2.5, ("priority", "default"))
    assert (legacy.name, legacy.named, legacy.weight) == (legacy_name("sk-legacy"), False, 1.0)
    assert legacy.service_tiers == DEFAULT_TIERS


def test_a_tenant_runs_on_the_tier_asked_or_its_own_default() -> None:
    """None ("auto") is the tenant's default; a tier it may use is taken; another is a
    400 naming it and the tiers allowed."""
    tenant = Tenant("k", tiers=("priority", "default"), tier="default")
    assert tenant.tier_for(None) == "default"
    assert tenant.tier_for("priority") == "priority"
    assert tenant.top == "priority"
    with pytest.raises(RequestError) as refused:
        tenant.tier_for("flex")
    assert refused.value.status == 400
    assert refused.value.param == "service_tier"
    assert "'flex'" in refused.value.message
    assert "'priority', 'default'" in refused.value.message
    assert Tenant("127.0.0.1").top == "default"
    assert [band(t) for t in ("priority", "default", "flex")] == [0, 1, 2]
