"""Tenants and service tiers: whose request waits when the fleet is full, and in which band.

A tenant is whom the admission queue shares the node slots between: an API key (a
`[[keys]]` entry, or one of `[server] api_keys`, each its own), or, with no keys
configured, the client's address. Its `weight` is its share of the slots among the
tenants with requests waiting (`[[keys]] weight`; 1 for the others).

A request runs on a service tier, OpenAI's word: `priority`, `default` or `flex`
(`SERVICE_TIERS`, in the order the queue's bands are served; `band` is a tier's
place). `Tenant.tier_for` turns what a request asked for (its `service_tier`; absent
or "auto": the key's default) into the tier it runs on, or the 400 naming a tier the
key may not use. The tiers a tenant without a `[[keys]]` entry may use are
`DEFAULT_TIERS`, its default "default".

The HTTP layer makes a request's tenant (it knows the key and the address); the
fleet only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge.config import SERVICE_TIERS
from edge.errors import RequestError

__all__ = ["DEFAULT_TIERS", "SERVICE_TIERS", "Tenant", "band"]

# What a key may ask for unless its `[[keys]] service_tiers` says otherwise.
DEFAULT_TIERS = ("default", "flex")
_BANDS = {tier: i for i, tier in enumerate(SERVICE_TIERS)}


def band(tier: str) -> int:
    """The tier's band of the queue: 0 (priority) is served first."""
    return _BANDS[tier]


@dataclass(frozen=True, slots=True)
class Tenant:
    """Whom a request is counted for in the admission queue (see the module doc)."""

    name: str
    weight: float = 1.0
    tiers: tuple[str, ...] = DEFAULT_TIERS
    tier: str = "default"
    # A `[[keys]]` entry: its name may be a metric label (a bounded set of values).
    named: bool = False

    @property
    def top(self) -> str:
        """The most urgent tier it may ask for."""
        return min(self.tiers, key=band)

    def tier_for(self, asked: str | None) -> str:
        """The tier a request asking for `asked` runs on (None: it asked for none, or
        "auto"); RequestError (400, `param: "service_tier"`) for a tier it may not use."""
        if asked is None:
            return self.tier
        if asked not in self.tiers:
            allowed = ", ".join(repr(t) for t in self.tiers)
            raise RequestError(
                f"The service tier {asked!r} is not available to this API key; it may use"
                f" {allowed} (or 'auto': {self.tier!r}).",
                param="service_tier",
                code="service_tier_not_allowed",
            )
        return asked
