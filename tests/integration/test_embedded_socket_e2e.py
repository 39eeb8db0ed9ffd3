"""The nodes an edge serves inside itself (`address = "embedded"`, `openai+http://`)
listen on no TCP port: each on a Unix socket in a directory only the edge's user opens.

The edges are the `iop-edge` console script in subprocesses; the `openai+http://`
node's model server is another edge (an OpenAI-compatible server with an embedded
node). What each process listens on is read from the kernel (psutil: its sockets),
not from anything the edge says. Waits on other processes are bounded; nothing here
sleeps for timing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path

import httpx
import psutil  # type: ignore[import-untyped]
import pytest
from loguru import logger

from edge.node.bridge import asyncio_loop
from edge.node.client import GrpcNodeClient
from edge.nodes import embedded
from edge.nodes.embedded import SOCKET_NAME, embedded_node
from tests.integration.conftest import chat_body
from tests.integration.edgeproc import EdgeProcess, edge_process

CHAT = "/v1/chat/completions"
EMBEDDED = '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'


def relay_toml(upstream: str) -> str:
    return f'{EMBEDDED}[[nodes]]\nname = "relay"\naddress = "openai+{upstream}/v1"\n'


async def streamed_text(url: str, text: str) -> str:
    """A streamed chat completion of sim-echo: its text, once [DONE] came."""
    body = chat_body("sim-echo", text, stream=True)
    pieces: list[str] = []
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        http.stream("POST", CHAT, json=body) as response,
    ):
        assert response.status_code == 200
        data = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    for line in data[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        if chunk["choices"]:
            pieces.append(chunk["choices"][0]["delta"].get("content") or "")
    return "".join(pieces)


def http_port(edge: EdgeProcess) -> int:
    return int(edge.url.rsplit(":", 1)[1])


def tcp_listening_ports(pid: int) -> set[int]:
    return {
        c.laddr.port
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def node_sockets(pid: int) -> set[Path]:
    """The paths of the node sockets `pid` has open (the listener and its connections)."""
    return {
        Path(c.laddr)
        for c in psutil.Process(pid).net_connections(kind="unix")
        if isinstance(c.laddr, str) and c.laddr.endswith("/" + SOCKET_NAME)
    }


def assert_private(directory: Path, pid: int) -> None:
    info = directory.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == psutil.Process(pid).uids().effective == os.geteuid()


async def test_embedded_and_openai_http_nodes_listen_on_a_private_unix_socket(
    tmp_path: Path,
) -> None:
    """An edge with an embedded node, and an edge with an `openai+http://` node in front
    of it: each serves a streamed chat completion; neither process listens on any TCP
    port but its HTTP one; each node's socket is in a directory of mode 0700 owned by
    the edge's user, and that directory is gone once the edge stopped."""
    async with edge_process(tmp_path, EMBEDDED, name="model") as model:
        async with edge_process(tmp_path, relay_toml(model.url), name="relay") as relay:
            directories = {}
            for edge in (model, relay):
                assert await streamed_text(edge.url, "hello there") == "hello there"
                pid = edge.process.pid
                assert tcp_listening_ports(pid) == {http_port(edge)}
                (path,) = node_sockets(pid)
                assert_private(path.parent, pid)
                directories[edge.url] = path.parent
            assert len(set(directories.values())) == 2
            relay.signal(signal.SIGTERM)
            assert await relay.wait_exit() == 0
            assert not directories[relay.url].exists()
            assert await streamed_text(model.url, "still here") == "still here"
        model.signal(signal.SIGTERM)
        assert await model.wait_exit() == 0
    assert not directories[model.url].exists()


async def test_each_worker_has_its_own_private_node_socket(tmp_path: Path) -> None:
    """`workers = 2` with an embedded node: every worker serves it on a socket of its own,
    in a directory of mode 0700 inside the edge run's directory; no process of the edge
    listens on a TCP port but the HTTP one; after a stop every directory is gone."""
    toml = EMBEDDED + "workers = 2\n"
    async with edge_process(tmp_path, toml, log_format="json") as edge:
        await edge.wait_line(r"serving on \S+ \(2 workers\)")
        supervisor = psutil.Process(edge.process.pid)
        children = supervisor.children()
        assert len(children) == 2
        assert await streamed_text(edge.url, "hello there") == "hello there"
        for process in (supervisor, *children):
            assert tcp_listening_ports(process.pid) <= {http_port(edge)}
        assert node_sockets(supervisor.pid) == set()
        directories = set()
        for worker in children:
            (path,) = node_sockets(worker.pid)
            assert_private(path.parent, worker.pid)
            assert_private(path.parent.parent, worker.pid)  # the edge run's directory
            directories.add(path.parent)
        assert len(directories) == 2
        edge.signal(signal.SIGTERM)
        assert await edge.wait_exit() == 0
    assert not any(d.exists() for d in directories)


async def test_in_a_run_directory_the_node_socket_is_in_a_private_directory_of_its_own() -> None:
    """`run_dir` given: the node's directory is a new one inside it (mode 0700), reached
    by path and named `embedded`; it is removed when the node stops. (The run directory
    is a short one of the system's temporary directory, as the supervisor's is: a test's
    own can be longer than a socket's path may be.)"""
    run_dir = Path(tempfile.mkdtemp(prefix="iop-run-"))
    try:
        async with asyncio_loop(), embedded_node("n", run_dir=run_dir) as (_, where):
            assert where.path is not None
            assert (where.host, where.port, where.address) == (None, None, "embedded")
            directory = Path(where.path).parent
            assert directory.parent == run_dir
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700
            client = GrpcNodeClient("n", where)
            try:
                assert "sim-echo" in (await client.describe()).models
            finally:
                await client.aclose()
        assert not directory.exists()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_without_unix_sockets_the_node_listens_on_loopback_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an OS without AF_UNIX the node listens on a 127.0.0.1 port, and a warning says
    that any local user reaches it."""
    monkeypatch.setattr(embedded, "UNIX_SOCKETS", False)
    warnings: list[str] = []
    sink = logger.add(warnings.append, level="WARNING", format="{message}")
    try:
        async with asyncio_loop(), embedded_node("n") as (_, where):
            assert (where.host, where.path, where.address) == ("127.0.0.1", None, "embedded")
            assert where.port
            client = GrpcNodeClient("n", where)
            try:
                assert "sim-echo" in (await client.describe()).models
            finally:
                await client.aclose()
    finally:
        logger.remove(sink)
    assert any(f"127.0.0.1:{where.port}" in w and "any local user" in w for w in warnings)
