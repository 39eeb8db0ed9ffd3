"""Addresses: `HOST:PORT`, and the `openai+http(s)://` form of a node served in-process.

Pure parsing, raising ValueError with a readable message; knows nothing of TOML or of
the settings, so a node's command can check its `--listen` without loading them.
"""

from __future__ import annotations

import ipaddress
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
