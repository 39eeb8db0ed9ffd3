"""The client-conformance suite's fixtures: one real edge and one sim node per session.

The clients under test are sync (or run their own asyncio loop), so the
tests are plain functions and the edge is an `iop-edge` process, started
once for the session on an ephemeral 127.0.0.1 port in front of an
`iop-sim-node` process; every request crosses both sockets. Scripts for the
sim node are built with `tests.clients.scripts`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.conftest import SimProcess, start_sim, stop_process

STARTUP_TIMEOUT_S = 30.0
_SERVING = re.compile(r"serving on (http://[^\s\",}]+)")


@dataclass
class EdgeServer:
    """A running `iop-edge` process: its base URL and every stderr line so far."""

    process: subprocess.Popen[str]
    url: str = ""
    lines: list[str] = field(default_factory=list)
    serving: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """What OpenAI clients take as `base_url`."""
        return self.url + "/v1"

    def read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            match = _SERVING.search(line)
            if match and not self.serving.is_set():
                self.url = match.group(1)
                self.serving.set()
        self.serving.set()  # EOF: the process ended; the waiter sees url == ""


def start_edge_process(tmp: Path, sim: SimProcess) -> EdgeServer:
    config = tmp / "edge.toml"
    config.write_text(
        "[server]\n"
        'listen = "127.0.0.1:0"\n'
        "keepalive_s = 0\n"
        "[[nodes]]\n"
        'name = "sim"\n'
        f'address = "{sim.address}"\n'
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "edge", "--config", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    server = EdgeServer(process)
    server.reader = threading.Thread(target=server.read, daemon=True)
    server.reader.start()
    if not server.serving.wait(STARTUP_TIMEOUT_S) or not server.url:
        stop_edge_process(server)
        raise RuntimeError("iop-edge did not start:\n" + "".join(server.lines))
    return server


def stop_edge_process(server: EdgeServer) -> None:
    stop_process(server.process)
    if server.reader is not None:
        server.reader.join(10)  # EOF once the process is gone; then the pipe can close
    if server.process.stderr is not None:
        server.process.stderr.close()


@pytest.fixture(scope="session")
def client_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    node = start_sim(tmp_path_factory.mktemp("clients-sim"))
    yield node
    stop_process(node.process)


@pytest.fixture(scope="session")
def edge_server(
    tmp_path_factory: pytest.TempPathFactory, client_sim: SimProcess
) -> Iterator[EdgeServer]:
    server = start_edge_process(tmp_path_factory.mktemp("clients-edge"), client_sim)
    yield server
    stop_edge_process(server)


@pytest.fixture(scope="session")
def base_url(edge_server: EdgeServer) -> str:
    return edge_server.base_url
