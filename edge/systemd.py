"""sd_notify: READY=1, STOPPING=1 and watchdog pings on $NOTIFY_SOCKET.

A few lines over an AF_UNIX datagram socket ("@" = the abstract namespace),
so no libsystemd is needed. Without $NOTIFY_SOCKET every call is a no-op.
"""

from __future__ import annotations

import os
import socket

import trio


def _address() -> str | None:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return None
    if path.startswith("@"):
        return "\0" + path[1:]
    return path


def notify(message: str) -> bool:
    """Send one state line to systemd; False when not under systemd (or it failed)."""
    address = _address()
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError:
        return False
    return True


def watchdog_interval() -> float | None:
    """Half of $WATCHDOG_USEC in seconds, when systemd asks for pings (and they are for us)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1_000_000 / 2


async def watchdog_loop(interval: float) -> None:
    """Ping systemd while the trio loop runs (a stuck loop stops the pings)."""
    while True:
        notify("WATCHDOG=1")
        await trio.sleep(interval)
