"""Addresses: `HOST:PORT`, the `openai+http(s)://` form of a node served in-process, the
DNS names nodes are discovered by (`dns+srv://NAME`, `dns://NAME:PORT`: `Discover`) and
the nameservers asked for them.

Pure parsing, raising ValueError with a readable message; knows nothing of TOML or of
the settings, so a node's command can check its `--listen` without loading them.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit


def check_node_address(address: str) -> None:
    """Raise ValueError unless `address` is HOST:PORT or openai+http(s)://HOST:PORT/PATH."""
    if upstream_url(address) is None:
        split_address(address)


UPSTREAM_SCHEMES = ("openai+http://", "openai+https://")


def upstream_url(address: str) -> str | None:
    """The server URL of an `openai+http(s)://HOST:PORT/PATH` node address; None for others.

    Such a node is served in-process by `edge.nodes.upstream`; raises ValueError
    when the address has the scheme but no host or a bad port.
    """
    if not address.startswith(UPSTREAM_SCHEMES):
        return None
    url = address.removeprefix("openai+")
    try:
        parts = urlsplit(url)
        valid = bool(parts.hostname) and (parts.port is None or parts.port >= 0)
    except ValueError:  # a port that is not a number or out of range
        valid = False
    if not valid:
        raise ValueError(f"expected openai+http://HOST:PORT/v1, got {address!r}")
    return url


def split_address(value: str) -> tuple[str, int]:
    """`HOST:PORT` as (host, port); raises ValueError with a readable message."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP address) is this machine only: `localhost` or a
    loopback address. Any other name, and the wildcard addresses, are not."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


DISCOVER_SCHEMES = ("dns+srv://", "dns://")
# A DNS name as written in a `discover` address: labels of letters, digits, `-` and `_`
# (SRV names begin with `_service._proto`), 1 to 63 each, dot-separated, a final dot allowed.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_DNS_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_MAX_NAME = 253


@dataclass(frozen=True, slots=True)
class Discover:
    """Where the nodes of a `discover` entry are found: the SRV records of `name` (each
    a target and a port), or its A and AAAA records (each an address, on `port`)."""

    name: str
    srv: bool
    port: int = 0


def parse_discover(value: str) -> Discover:
    """`dns+srv://NAME` or `dns://NAME:PORT`; raises ValueError with a readable message."""
    srv = value.startswith("dns+srv://")
    if not srv and not value.startswith("dns://"):
        raise ValueError(f"expected dns+srv://NAME or dns://NAME:PORT, got {value!r}")
    rest = value.split("://", 1)[1]
    port = 0
    if not srv:
        name, sep, digits = rest.rpartition(":")
        if not sep or not digits.isdigit() or not 0 < int(digits) <= 65535:
            raise ValueError(f"expected dns://NAME:PORT (PORT from 1 to 65535), got {value!r}")
        rest, port = name, int(digits)
    if len(rest) > _MAX_NAME or _DNS_NAME.fullmatch(rest) is None:
        raise ValueError(f"{rest!r} is not a DNS name (in {value!r})")
    return Discover(rest, srv, port)


def parse_nameserver(value: str) -> tuple[str, int]:
    """A nameserver: an IP address, with a port (`127.0.0.1:5353`, `[::1]:5353`) or
    without (53); raises ValueError with a readable message."""
    host, port = value, 53
    if value.startswith("[") or value.count(":") == 1:
        host, port = split_address(value)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"expected an IP address, optionally with a port (10.0.0.10, 127.0.0.1:5353,"
            f" [::1]:5353), got {value!r}"
        ) from None
    if port == 0:
        raise ValueError(f"a nameserver's port is 1 to 65535, got {value!r}")
    return host, port
