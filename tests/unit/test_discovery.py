"""Nodes found by DNS, piece by piece: the `discover` and nameserver addresses, the
`[[nodes]]` and `[discovery]` keys, the resolver against a real DNS server on a local
port (`tools.dnszone`), and how `Discovery` turns answers into nodes and keeps the last
one when a look-up fails. The edge as a whole: tests/integration/test_discovery_e2e.py.
"""

from __future__ import annotations

import pytest
import trio

from edge.config import ConfigError, DiscoveryConfig, NodeConfig, parse_config
from edge.config.address import Discover, parse_discover, parse_nameserver
from edge.process.discovery import Discovery, node_of
from edge.process.resolver import MAX_FOUND, Found, LookupFailed, Resolver
from tools.dnszone import Zone, serve_zone


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("dns+srv://_grpc._tcp.iop-node.default.svc.cluster.local",
         Discover("_grpc._tcp.iop-node.default.svc.cluster.local", srv=True)),
        ("dns://iop-node-headless.default.svc:50051",
         Discover("iop-node-headless.default.svc", srv=False, port=50051)),
        ("dns://node.example.:1", Discover("node.example.", srv=False, port=1)),
    ],
)  # fmt: skip
def test_discover_addresses(text: str, expected: Discover) -> None:
    """Both forms parse into the name, the kind and (dns://) the port."""
    assert parse_discover(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "dns://node.example",  # no port
        "dns://node.example:0",
        "dns://node.example:65536",
        "dns+srv://node.example:50051",  # SRV records carry the port
        "dns+srv://",
        "dns://bad..name:1",
        "dns://-dash.example:1",
        "http://node.example:1",
        "node.example:1",
        f"dns://{'a' * 64}.example:1",  # a label over 63
    ],
)
def test_discover_addresses_refused(text: str) -> None:
    """A malformed discover address is a ValueError naming what was expected."""
    with pytest.raises(ValueError, match=r"expected|not a DNS name"):
        parse_discover(text)


def test_nameservers() -> None:
    """An IP address, with a port or without (53); IPv6 in brackets with a port."""
    assert parse_nameserver("10.96.0.10") == ("10.96.0.10", 53)
    assert parse_nameserver("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_nameserver("[::1]:5353") == ("::1", 5353)
    assert parse_nameserver("::1") == ("::1", 53)
    for bad in ("dns.example", "dns.example:53", "127.0.0.1:0", "127.0.0.1:x"):
        with pytest.raises(ValueError, match=r"expected|port"):
            parse_nameserver(bad)


def test_the_keys_of_a_discover_entry() -> None:
    """An entry with discover has no address; its name is the DNS name unless given; its
    interval, and `[discovery]`, are read with their bounds."""
    doc = {
        "nodes": [
            {"discover": "dns+srv://_grpc._tcp.pool.example.", "discover_interval_s": 0.1},
            {"name": "b", "discover": "dns://pool.example:50051", "tls": True},
        ],
        "discovery": {"nameservers": ["127.0.0.1:5353"], "timeout_s": 0.5},
    }
    config = parse_config(doc, "c.toml")
    first, second = config.nodes
    assert (first.name, first.address, first.discover_interval_s) == (
        "_grpc._tcp.pool.example", "", 0.1)  # fmt: skip
    assert first.discovered
    assert second.discovered
    assert second.name == "b"
    assert second.tls
    assert config.discovery == DiscoveryConfig(("127.0.0.1:5353",), 0.5)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"nodes": [{"address": "a:1", "discover": "dns://a:1"}]}, r"nodes\[0\]\.discover"),
        ({"nodes": [{"name": "x"}]}, r"nodes\[0\]\.address: missing"),
        ({"nodes": [{"discover": "dns://a"}]}, r"nodes\[0\]\.discover: expected dns://"),
        ({"nodes": [{"discover": "dns://a:1", "discover_interval_s": 0.001}]},
         r"discover_interval_s"),
        ({"discovery": {"nameservers": ["dns.example"]}}, r"discovery\.nameservers"),
        ({"discovery": {"timeout_s": 0}}, r"discovery\.timeout_s"),
    ],
)  # fmt: skip
def test_discover_mistakes(doc: dict[str, object], message: str) -> None:
    """Each mistake is one ConfigError naming the file and the key."""
    with pytest.raises(ConfigError, match=message):
        parse_config(doc, "c.toml")


def test_a_found_address_is_a_node_of_its_entry() -> None:
    """`NAME/HOST:PORT`, the entry's other settings; with TLS and no server_name, the
    certificate must carry the name the address was found under."""
    entry = NodeConfig("pool", "", discover="dns://pool.example:7", max_runs=3, tls=True)
    node = node_of(entry, Found("10.0.0.5", 7, "pool.example"))
    assert (node.name, node.address, node.max_runs, node.server_name) == (
        "pool/10.0.0.5:7", "10.0.0.5:7", 3, "pool.example")  # fmt: skip
    assert not node.discovered
    six = node_of(entry, Found("fd00::5", 7, "pool.example"))
    assert (six.name, six.address) == ("pool/[fd00::5]:7", "[fd00::5]:7")
    entry = NodeConfig("p", "", discover="dns://a:1", tls=True, server_name="n")
    assert node_of(entry, Found("::1", 1, "a")).server_name == "n"


async def resolver_of(zone: Zone, nursery: trio.Nursery, timeout_s: float) -> Resolver:
    """A resolver asking `zone`, served on a local port in `nursery`."""
    port = await nursery.start(serve_zone, zone)
    settings = DiscoveryConfig((f"127.0.0.1:{port}",), timeout_s=timeout_s)
    return await trio.to_thread.run_sync(Resolver, settings)


@pytest.fixture
async def dns(nursery: trio.Nursery) -> tuple[Zone, Resolver]:
    """A DNS server on a local port, and a resolver asking it (each look-up within 10 s:
    what passes that is a failure of the test machine, not of a look-up)."""
    zone = Zone()
    return zone, await resolver_of(zone, nursery, 10.0)


async def test_lookups(dns: tuple[Zone, Resolver]) -> None:
    """dns://: every A and AAAA record on the port; dns+srv://: each target's addresses on
    its port, from the additional section or, without it, asked; 150 SRV records (past a
    UDP answer: over TCP) give 150 nodes, sorted, each once."""
    zone, resolver = dns
    zone.set_addresses("pool.test", ["127.0.0.2", "127.0.0.1", "::1"])
    found = await resolver.lookup(parse_discover("dns://pool.test:9"))
    assert [f.address for f in found] == ["127.0.0.1:9", "127.0.0.2:9", "[::1]:9"]
    assert {f.target for f in found} == {"pool.test"}
    records = [(f"t{i}.pool.test", 1000 + i) for i in range(150)]
    zone.set_srv("_grpc._tcp.pool.test", [*records, (".", 5), ("t0.pool.test", 0)])
    for target, _ in records:
        zone.set_addresses(target, ["127.0.0.1"])
    for additional in (True, False):
        zone.additional = additional
        found = await resolver.lookup(parse_discover("dns+srv://_grpc._tcp.pool.test"))
        assert [(f.port, f.target) for f in found] == sorted(
            (port, target) for target, port in records
        )


async def test_lookup_failures(nursery: trio.Nursery) -> None:
    """Each way a look-up fails, with its reason: the name does not exist, has no address,
    the server fails, the server says nothing (within timeout_s, here 1 s)."""
    zone = Zone()
    resolver = await resolver_of(zone, nursery, 1.0)
    zone.set_addresses("empty.test", [])
    zone.set_addresses("pool.test", ["127.0.0.1"])
    cases = [
        ("dns://nothing.test:1", "answer", "nxdomain"),
        ("dns://empty.test:1", "answer", "empty"),
        ("dns://pool.test:1", "servfail", "servfail"),
        ("dns://pool.test:1", "silent", "timeout"),
    ]
    for text, mode, reason in cases:
        zone.mode = mode
        with pytest.raises(LookupFailed) as failed:
            await resolver.lookup(parse_discover(text))
        assert failed.value.reason == reason


async def test_many_addresses_are_capped(dns: tuple[Zone, Resolver]) -> None:
    """A name with more addresses than MAX_FOUND gives the first MAX_FOUND, sorted."""
    zone, resolver = dns
    many = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(MAX_FOUND + 5)]
    zone.set_addresses("many.test", many)
    found = await resolver.lookup(parse_discover("dns://many.test:1"))
    assert len(found) == MAX_FOUND
    assert found == sorted(found)


async def test_a_failed_lookup_keeps_the_last_answer(nursery: trio.Nursery) -> None:
    """Discovery: the nodes of the last answer, however many look-ups fail after it (each
    counted with its entry and reason); a new answer replaces it; an entry with an
    address stays as it is; a name never answered has no node."""
    zone = Zone()
    resolver = await resolver_of(zone, nursery, 1.0)
    errors: list[tuple[str, str]] = []
    discovery = Discovery(resolver, lambda entry, reason: errors.append((entry, reason)))
    entries = (
        NodeConfig("static", "127.0.0.1:1"),
        NodeConfig("pool", "", discover="dns://pool.test:7"),
        NodeConfig("never", "", discover="dns://never.test:7"),
    )
    zone.set_addresses("pool.test", ["127.0.0.1", "127.0.0.2"])
    await discovery.resolve(entries)
    names = ["static", "pool/127.0.0.1:7", "pool/127.0.0.2:7"]
    assert [n.name for n in discovery.nodes(entries)] == names
    assert errors == [("never", "nxdomain")]
    zone.mode = "servfail"
    await discovery.resolve(entries)
    zone.mode = "silent"
    await discovery.resolve(entries)
    assert [n.name for n in discovery.nodes(entries)] == names
    assert sorted(errors[1:]) == [
        ("never", "servfail"), ("never", "timeout"), ("pool", "servfail"), ("pool", "timeout"),
    ]  # fmt: skip
    zone.mode = "answer"
    zone.set_addresses("pool.test", ["127.0.0.3"])
    await discovery.resolve(entries)
    assert [n.name for n in discovery.nodes(entries)] == ["static", "pool/127.0.0.3:7"]
