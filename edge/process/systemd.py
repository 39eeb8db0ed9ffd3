"""sd_notify: READY=1, STOPPING=1 and watchdog pings on $NOTIFY_SOCKET, or to the supervisor.

A few lines over an AF_UNIX datagram socket ("@" = the abstract namespace),
so no libsystemd is needed. Without $NOTIFY_SOCKET every call is a no-op.

A worker process (`iop-edge --workers N`, `edge.process.supervisor`) never talks to
systemd: `attach_supervisor` points the same calls at the worker's end of
a socket pair it inherited, so READY=1, STOPPING=1 and the watchdog pings
(at the pace the supervisor asked for) go to the supervisor, which speaks to
systemd for the whole edge.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import trio

_supervisor: socket.socket | None = None
_heartbeat_s: float | None = None


def attach_supervisor(fd: int, heartbeat_s: float | None) -> socket.socket:
    """This process is a worker: notifications go over `fd` (a SOCK_SEQPACKET) from now on.

    `heartbeat_s`: how often to send WATCHDOG=1 (None: the supervisor needs no pings).
    """
    global _supervisor, _heartbeat_s
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    _supervisor, _heartbeat_s = sock, heartbeat_s
    return sock


def _address() -> str | None:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return None
    if path.startswith("@"):
        return "\0" + path[1:]
    return path


def notify(message: str) -> bool:
    """Send one state line to systemd (or the supervisor); False when nobody listens."""
    if _supervisor is not None:
        try:  # non-blocking: a supervisor that stopped reading never stalls the loop
            _supervisor.send(message.encode())
        except OSError:
            return False
        return True
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
    """Half of $WATCHDOG_USEC in seconds, when systemd asks for pings (and they are for us).

    In a worker: the supervisor's heartbeat interval.
    """
    if _supervisor is not None:
        return _heartbeat_s
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


def state_directory() -> Path | None:
    """systemd's `StateDirectory=` for this service ($STATE_DIRECTORY: its first path when
    it lists several), None when unset."""
    value = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(value) if value else None
