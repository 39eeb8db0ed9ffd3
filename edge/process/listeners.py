"""The edge's listening sockets: bound once, before any worker serves them.

Owns how a listen address becomes sockets: the addresses it resolves to
(IPv6 sockets are IPv6-only, as trio binds them), SO_REUSEADDR, the listen
queue, and for `SO_REUSEPORT` sets (one per worker) the holder that keeps
the port; and the process's file-descriptor limit, which bounds the
connections the sockets may carry (`raise_fd_limit`, `default_max_connections`).
Knows nothing of processes (`edge.process.supervisor`) or HTTP.
"""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Sequence
from typing import Any

from edge.config.address import split_address

# The listen queue of every listening socket (single process and workers alike).
LISTEN_BACKLOG = 2048
LISTEN_MODE_ENV = "IOP_EDGE_LISTEN_MODE"
LISTEN_MODES = ("shared", "reuseport")
# File descriptors kept for what is not a client connection (nodes, logs, files).
FD_RESERVE = 128


def listen_mode() -> str:
    """How workers listen (`$IOP_EDGE_LISTEN_MODE`): `shared` (default) or `reuseport`.
    Workers inherit the variable, so the supervisor and its workers agree."""
    mode = os.environ.get(LISTEN_MODE_ENV, LISTEN_MODES[0])
    return mode if mode in LISTEN_MODES else LISTEN_MODES[0]


def _listener(
    family: int, kind: int, proto: int, address: Any, *, reuse_port: bool, listen: bool
) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        if listen:
            sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def bind_listeners(
    listen: str, copies: int
) -> tuple[list[list[socket.socket]], list[socket.socket]]:
    """Listening sockets for `listen` (HOST:PORT): (`copies` sets of them, port holders).

    One set: plain sockets, as the single process binds, and no holder. More:
    per address, first a holder (SO_REUSEPORT, bound, never listening: it keeps
    the port for the edge while every listening socket of the address may be
    closed), then `copies` listening sockets with SO_REUSEPORT on its port (port 0:
    the port the holder got). Raises OSError when an address cannot be bound.
    """
    host, port = split_address(listen)
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    groups: list[list[socket.socket]] = [[] for _ in range(copies)]
    holders: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    reuse_port = copies > 1
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            if reuse_port:
                holder = _listener(family, kind, proto, address, reuse_port=True, listen=False)
                holders.append(holder)
                address = holder.getsockname()
            for group in groups:
                group.append(
                    _listener(family, kind, proto, address, reuse_port=reuse_port, listen=True)
                )
    except OSError:
        for sock in [*holders, *(s for g in groups for s in g)]:
            sock.close()
        raise
    return groups, holders


Address = tuple[int, int, int, Any]  # family, type, proto, socket address


def addresses(sockets: Sequence[socket.socket]) -> list[Address]:
    return [(s.family, s.type, s.proto, s.getsockname()) for s in sockets]


def rebind(where: Sequence[Address]) -> list[socket.socket]:
    """New SO_REUSEPORT listening sockets on `where` (a worker slot's, again)."""
    return [_listener(f, t, p, a, reuse_port=True, listen=True) for f, t, p, a in where]


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def raise_fd_limit() -> int:
    """Raise the soft file-descriptor limit to the hard one; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


def default_max_connections(fd_limit: int) -> int:
    """Connections the fd limit allows, keeping `FD_RESERVE` for everything else."""
    return max(16, fd_limit - FD_RESERVE)
