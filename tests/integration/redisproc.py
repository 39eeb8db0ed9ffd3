"""A real `redis-server` on an ephemeral 127.0.0.1 port, for the limits tests.

Redis cannot bind port 0, so a free port is picked and the start retried on
a clash. No persistence (`--save "" --appendonly no`). Without the binary
the tests skip with a plain message on a developer machine (`make setup`
installs it when run as root), and fail under CI (`CI=true`), where the
setup must have installed it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.integration.edgeproc import free_port

_START_TRIES = 5
_START_TIMEOUT_S = 10.0


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def pause(self) -> None:
        """Stop the server without closing anything (SIGSTOP): a blip, as clients see it,
        whose connections are still there once it is resumed."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        """A plain client of this server, to look at what the edge wrote."""
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def stop(self) -> None:
        """Kill the server (an outage, as the edge sees it) and wait for it to be gone."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def redis_binary() -> str:
    """The redis-server path; skips (fails under CI) when it is missing."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    message = (
        "redis-server is not installed: the Redis limits tests need it"
        " (`make setup` installs Debian's redis-server when run as root)"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(workdir: Path) -> RedisServer:
    binary = redis_binary()
    for _ in range(_START_TRIES):
        port = free_port()
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", str(workdir), "--loglevel", "warning"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + _START_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            if _answers(port):
                return RedisServer(port, process)
            time.sleep(0.01)  # another process starting: poll, bounded
        process.kill()
        process.wait(10)  # exited: most likely the port was taken meanwhile; another one
    raise RuntimeError(f"redis-server did not start in {_START_TRIES} tries")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path)
    yield server
    server.stop()
