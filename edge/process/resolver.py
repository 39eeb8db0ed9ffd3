"""DNS look-ups of the names `[[nodes]]` entries discover their nodes by (`discover`).

Owns the process's one resolver: dnspython's (`dns.asyncresolver`) on its trio
backend, asking `[discovery] nameservers` (or the system's, with its search domains), with
no cache: each look-up asks the server, which is what a fleet that changes needs.
`Resolver.lookup` turns a `Discover` into the addresses of its nodes (`Found`, sorted,
each once, at most `MAX_FOUND`):

- `dns+srv://NAME`: the SRV records of NAME, each a target and a port (a target of "."
  or a port of 0 is no node); each target's addresses from the answer's additional
  section when the server put them there (Kubernetes' DNS does), else from its A and
  AAAA records, looked up `TARGET_LOOKUPS` at a time. Priority and weight are not read:
  every target is a node, and the picker spreads runs by load.
- `dns://NAME:PORT`: the A and AAAA records of NAME, each address on PORT.

A look-up that fails raises `LookupFailed` with the reason the metric counts
(`edge.observe.catalog.DISCOVERY_ERRORS`): this is the one place where dnspython's
errors become the edge's. A name with no address is a failure too (`empty`), so that
a blip of the DNS never empties a fleet; a target of an SRV answer that has none is only
left out. The whole look-up, its retries and its targets', is bounded by
`[discovery] timeout_s`. Knows nothing of nodes, pools or configurations beyond its
settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import dns.asyncbackend
import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver
import trio

from edge.config import DiscoveryConfig
from edge.config.address import Discover, parse_nameserver

# The addresses one name may give: past it, the first ones (sorted) are kept.
MAX_FOUND = 1000
# SRV targets looked up at once when the answer carries no addresses for them.
TARGET_LOOKUPS = 16
# What a server may answer in one UDP message (EDNS0): 100 A records fit, past it the
# resolver asks again over TCP.
_UDP_PAYLOAD = 1232
_ADDRESS_TYPES = (dns.rdatatype.A, dns.rdatatype.AAAA)


@dataclass(frozen=True, slots=True, order=True)
class Found:
    """One node's address found by DNS: `host` an IP address, `target` the name it is the
    address of (what a certificate is checked against, with TLS and no server_name)."""

    host: str
    port: int
    target: str

    @property
    def address(self) -> str:
        """`HOST:PORT`, an IPv6 host in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class LookupFailed(Exception):
    """A look-up that gave no answer to go by; `reason` is the metric's label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Resolver:
    """Look-ups of discover names (see the module doc). Build it off the loop: with no
    nameservers it reads the system's resolver configuration."""

    def __init__(self, settings: DiscoveryConfig) -> None:
        self.settings = settings
        self._timeout_s = settings.timeout_s
        self._backend = dns.asyncbackend.get_backend("trio")
        # The system's configuration: its search domains apply to a name without a
        # final dot, as they do for the other programs of the machine.
        self._search = not settings.nameservers
        self._broken: str | None = None
        try:
            resolver = dns.asyncresolver.Resolver(configure=self._search)
        except dns.exception.DNSException as exc:  # no /etc/resolv.conf, or no server in it
            self._broken = f"no DNS server to ask: {exc} (set [discovery] nameservers)"
            resolver = dns.asyncresolver.Resolver(configure=False)
        if settings.nameservers:
            resolver.nameservers = [
                dns.nameserver.Do53Nameserver(*parse_nameserver(server))
                for server in settings.nameservers
            ]
        resolver.cache = None
        resolver.lifetime = resolver.timeout = settings.timeout_s
        resolver.use_edns(0, 0, _UDP_PAYLOAD)
        self._resolver = resolver

    async def lookup(self, discover: Discover) -> list[Found]:
        """The addresses of `discover`'s nodes, sorted (see the module doc); raises
        LookupFailed."""
        if self._broken is not None:
            raise LookupFailed("error", self._broken)
        try:
            with trio.fail_after(self._timeout_s):
                if discover.srv:
                    found = await self._srv(discover.name)
                else:
                    addresses = await self._addresses(discover.name, search=self._search)
                    target = discover.name.rstrip(".")
                    found = {Found(host, discover.port, target) for host in addresses}
        except trio.TooSlowError:
            raise LookupFailed("timeout", f"no answer within {self._timeout_s:g}s") from None
        except dns.resolver.NXDOMAIN:
            raise LookupFailed("nxdomain", "the name does not exist (NXDOMAIN)") from None
        except dns.resolver.NoNameservers as exc:
            raise LookupFailed("servfail", str(exc)) from None
        except dns.exception.Timeout:
            raise LookupFailed("timeout", f"no answer within {self._timeout_s:g}s") from None
        except (dns.exception.DNSException, OSError) as exc:
            raise LookupFailed("error", f"{type(exc).__name__}: {exc}") from None
        if not found:
            kind = "SRV records with an address" if discover.srv else "A or AAAA records"
            raise LookupFailed("empty", f"the name has no {kind}")
        return sorted(found)[:MAX_FOUND]

    async def _ask(
        self, name: str | dns.name.Name, rdtype: dns.rdatatype.RdataType, *, search: bool
    ) -> dns.resolver.Answer:
        return await self._resolver.resolve(
            name, rdtype, raise_on_no_answer=False, search=search, backend=self._backend
        )

    async def _addresses(self, name: str | dns.name.Name, *, search: bool) -> list[str]:
        """The A and AAAA records of `name`; raises NXDOMAIN when it does not exist."""
        addresses: list[str] = []
        for rdtype in _ADDRESS_TYPES:
            answer = await self._ask(name, rdtype, search=search)
            if answer.rrset is not None:
                addresses += [record.address for record in answer.rrset]
        return addresses

    async def _srv(self, name: str) -> set[Found]:
        """Each SRV record's target's addresses, on its port."""
        answer = await self._ask(name, dns.rdatatype.SRV, search=self._search)
        wanted: list[tuple[dns.name.Name, int]] = [
            (record.target, record.port)
            for record in answer.rrset or ()
            if record.port != 0 and record.target != dns.name.root
        ]
        known: dict[dns.name.Name, list[str]] = {}
        for rrset in answer.response.additional:
            if rrset.rdtype in _ADDRESS_TYPES:
                known.setdefault(rrset.name, []).extend(record.address for record in rrset)
        missing = {target for target, _ in wanted if target not in known}
        if missing:
            limiter = trio.CapacityLimiter(TARGET_LOOKUPS)
            async with trio.open_nursery() as nursery:
                for target in missing:
                    nursery.start_soon(self._target, target, known, limiter)
        return {
            Found(host, port, target.to_text(omit_final_dot=True))
            for target, port in wanted
            for host in known.get(target, ())
        }

    async def _target(
        self,
        target: dns.name.Name,
        known: dict[dns.name.Name, list[str]],
        limiter: trio.CapacityLimiter,
    ) -> None:
        """`target`'s addresses into `known` (none when it does not exist)."""
        async with limiter:
            try:
                known[target] = await self._addresses(target, search=False)
            except dns.resolver.NXDOMAIN:
                known[target] = []
