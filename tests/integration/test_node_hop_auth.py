"""The node hop locked: a node's bearer token, TLS and mutual TLS, over real processes.

A node started with `--token-file` answers every RPC without the token UNAUTHENTICATED
and serves an edge whose `[[nodes]]` entry names the file; one started with TLS and a
client CA serves an edge with the right client certificate and nobody else; SIGHUP
makes it read its files again; and a node asked to listen beyond loopback with no
credentials does not start. Certificates are made on the spot (trustme).
"""

from __future__ import annotations

import contextlib
import gc
import signal
import ssl
import subprocess
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import trio
import trustme
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from edge.config import parse_config
from edge.contract._proto.iop.node import v1 as pb
from edge.node.bridge import asyncio_loop, call_asyncio
from tests.integration.conftest import (
    SimProcess,
    chat_body,
    edge_config,
    sse_content,
    sse_frames,
    start_edge,
    start_sim,
    start_upstream_node,
    stop_edge,
    stop_process,
)

WAIT_S = 20.0
TOKEN = "s3cret-node-token"
RPCS = ("Describe", "CancelRun", "Run", "Watch")


@contextlib.contextmanager
def running(node: SimProcess) -> Iterator[SimProcess]:
    try:
        yield node
    finally:
        stop_process(node.process)


def client_context(ca: trustme.CA | None, cert: trustme.LeafCert | None = None) -> ssl.SSLContext:
    """A client's TLS: trusting `ca`'s certificates, showing `cert` when given."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.set_alpn_protocols(["h2"])
    if ca is not None:
        ca.configure_trust(context)
    if cert is not None:
        cert.configure_cert(context)
    return context


async def _statuses(
    address: str,
    metadata: dict[str, str] | None,
    tls: ssl.SSLContext | None,
    server_name: str | None,
) -> dict[str, Status | str]:
    """Each RPC of the service called once: its status (OK when it answered), or the
    name of the error that ended it before any status (a refused connection)."""
    host, port = address.rsplit(":", 1)
    config = Configuration(ssl_target_name_override=server_name) if server_name else None
    channel = Channel(host, int(port), ssl=tls, config=config)
    stub = pb.NodeServiceStub(channel)

    async def run() -> None:
        request = pb.RunRequest(
            run_id="auth-run", model="sim-echo", messages=[pb.Message(role="user", content="hi")]
        )
        async for _ in stub.run(request, metadata=metadata):
            pass

    async def watch() -> None:
        async with contextlib.aclosing(stub.watch(pb.WatchRequest(), metadata=metadata)) as reports:
            async for _ in reports:
                break

    calls = {
        "Describe": lambda: stub.describe(pb.DescribeRequest(), metadata=metadata),
        "CancelRun": lambda: stub.cancel_run(pb.CancelRunRequest(run_id="x"), metadata=metadata),
        "Run": run,
        "Watch": watch,
    }
    statuses: dict[str, Status | str] = {}
    try:
        for name, call in calls.items():
            try:
                await call()
                statuses[name] = Status.OK
            except GRPCError as exc:
                statuses[name] = exc.status
            except Exception as exc:  # the connection refused: TLS, a reset
                statuses[name] = type(exc).__name__
    finally:
        channel.close()
    return statuses


async def statuses(
    address: str,
    metadata: dict[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
) -> dict[str, Status | str]:
    async with asyncio_loop():
        with trio.fail_after(WAIT_S):
            found = await call_asyncio(_statuses, address, metadata, tls, server_name)
    # A connection the node refused (no TLS, no client certificate) can leave grpclib's
    # client a transport it never closes (its Channel.close() does not reach one whose
    # handshake the server ended): collected here, where it is expected, rather than in
    # whichever later test the garbage collector happens to run.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    return found


async def next_line(node: SimProcess) -> str:
    """The node's next line on stdout (what it says after a SIGHUP)."""
    assert node.process.stdout is not None
    with trio.fail_after(WAIT_S):
        return await trio.to_thread.run_sync(node.process.stdout.readline, abandon_on_cancel=True)


async def sighup(node: SimProcess) -> str:
    node.process.send_signal(signal.SIGHUP)
    return await next_line(node)


async def stream_through_edge(
    nursery: trio.Nursery, sim: SimProcess, entry: Mapping[str, object]
) -> str:
    """A streamed chat completion through an edge whose one `[[nodes]]` entry is `entry`
    (parsed as the config file's): the content it streamed."""
    nodes = parse_config({"nodes": [{"address": sim.address, **entry}]}, "<test>").nodes
    edge = await start_edge(nursery, replace(edge_config(sim), nodes=nodes))
    try:
        async with httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http:
            body = chat_body("sim-echo", "hello locked node", stream=True)
            async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
                assert answer.status_code == 200
                text = (await answer.aread()).decode()
        return sse_content(sse_frames(text))
    finally:
        await stop_edge(edge)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "node.token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


async def test_a_token_node_refuses_every_rpc_without_the_token(
    tmp_path: Path, token_file: Path
) -> None:
    """Run, CancelRun, Describe and Watch without the token, or with another, end
    UNAUTHENTICATED; with it, each is served."""
    with running(start_sim(tmp_path, "token", "--token-file", str(token_file))) as node:
        unauthenticated = dict.fromkeys(RPCS, Status.UNAUTHENTICATED)
        assert await statuses(node.address) == unauthenticated
        assert await statuses(node.address, {"authorization": "Bearer wrong"}) == unauthenticated
        assert await statuses(node.address, {"authorization": TOKEN}) == unauthenticated
        allowed = await statuses(node.address, {"authorization": f"Bearer {TOKEN}"})
        assert allowed == dict.fromkeys(RPCS, Status.OK)


async def test_an_edge_with_the_token_streams_through_a_token_node(
    nursery: trio.Nursery, tmp_path: Path, token_file: Path
) -> None:
    """An edge whose `[[nodes]]` entry names the token file streams a chat completion
    from a node that requires it (Describe, Watch and Run all carry the token)."""
    with running(start_sim(tmp_path, "token", "--token-file", str(token_file))) as node:
        entry = {"token_file": str(token_file)}
        assert await stream_through_edge(nursery, node, entry) == "hello locked node"


async def test_mutual_tls_serves_the_edge_with_its_certificate_and_nobody_else(
    nursery: trio.Nursery, tmp_path: Path, ca: trustme.CA
) -> None:
    """A node with TLS and a client CA: an edge with a client certificate of that CA
    streams (checking the node's certificate by `server_name`); a TLS client without a
    certificate and a plaintext client are refused, whatever they call."""
    server = ca.issue_cert("node.internal")
    server.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "node.pem"))
    server.private_key_pem.write_to_path(str(tmp_path / "node.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    client = ca.issue_cert("edge")
    client.cert_chain_pems[0].write_to_path(str(tmp_path / "edge.pem"))
    client.private_key_pem.write_to_path(str(tmp_path / "edge.key"))
    flags = (
        "--tls-cert", str(tmp_path / "node.pem"), "--tls-key", str(tmp_path / "node.key"),
        "--tls-client-ca", str(tmp_path / "ca.pem"),
    )  # fmt: skip
    with running(start_sim(tmp_path, "mtls", *flags)) as node:
        no_cert = await statuses(node.address, tls=client_context(ca), server_name="node.internal")
        plaintext = await statuses(node.address)
        for refused in (no_cert, plaintext):
            assert not any(status is Status.OK for status in refused.values()), refused
        with_cert = await statuses(
            node.address, tls=client_context(ca, client), server_name="node.internal"
        )
        assert with_cert == dict.fromkeys(RPCS, Status.OK)
        entry = {
            "ca_file": str(tmp_path / "ca.pem"),
            "cert_file": str(tmp_path / "edge.pem"),
            "key_file": str(tmp_path / "edge.key"),
            "server_name": "node.internal",
        }
        assert await stream_through_edge(nursery, node, entry) == "hello locked node"


async def test_sighup_rotates_the_certificate_and_the_token(
    tmp_path: Path, ca: trustme.CA, token_file: Path
) -> None:
    """After SIGHUP, new connections get the certificate now in the files (one of a new
    CA: a client trusting only the old CA is refused) and the token now in its file
    (the old one refused); a file that cannot be read keeps the running credentials."""
    cert, _key = tmp_path / "node.pem", tmp_path / "node.key"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
    # The key is in the chain file too; --tls-key names the same file.
    flags = ("--tls-cert", str(cert), "--tls-key", str(cert), "--token-file", str(token_file))
    with running(start_sim(tmp_path, "rotate", *flags)) as node:
        old = {"authorization": f"Bearer {TOKEN}"}
        assert (await statuses(node.address, old, client_context(ca)))["Describe"] is Status.OK

        new_ca = trustme.CA()
        new_ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
        await trio.Path(token_file).write_text("rotated-token\n")
        assert "credentials reloaded" in await sighup(node)

        new = {"authorization": "Bearer rotated-token"}
        assert (await statuses(node.address, new, client_context(new_ca)))["Describe"] is Status.OK
        refused_old_ca = await statuses(node.address, new, client_context(ca))
        assert refused_old_ca["Describe"] is not Status.OK
        old_token = await statuses(node.address, old, client_context(new_ca))
        assert old_token["Describe"] is Status.UNAUTHENTICATED

        await trio.Path(token_file).unlink()
        assert "not reloaded" in await sighup(node)
        assert (await statuses(node.address, new, client_context(new_ca)))["Describe"] is Status.OK


@pytest.mark.parametrize(
    "command",
    [
        ["edge.nodes.sim"],
        ["edge.nodes.upstream", "--upstream", "http://127.0.0.1:9/v1"],
    ],
)
def test_a_node_open_beyond_loopback_does_not_start(command: list[str]) -> None:
    """A node asked to listen on 0.0.0.0 with neither token nor TLS exits non-zero with
    one line saying why and how to fix it."""
    done = subprocess.run(
        [sys.executable, "-m", *command, "--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--token-file" in lines[0]
    assert "--insecure" in lines[0]


async def test_insecure_lets_a_node_listen_beyond_loopback(tmp_path: Path) -> None:
    """With --insecure the same node starts, and serves without credentials."""
    with running(start_sim(tmp_path, "open", "--listen", "0.0.0.0:0", "--insecure")) as node:
        port = node.address.rsplit(":", 1)[1]
        assert node.address.startswith("0.0.0.0:")
        assert (await statuses(f"127.0.0.1:{port}"))["Describe"] is Status.OK


async def test_iop_node_takes_its_token_from_the_flag_or_its_config_file(
    tmp_path: Path, token_file: Path
) -> None:
    """iop-node is locked the same way, by `--token-file` or its config file's
    `[node] token_file`: without the token every RPC is UNAUTHENTICATED; with it the
    node answers (Describe: UNAVAILABLE, its model server being down)."""
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\ntoken_file = "{token_file}"\n')
    down = "http://127.0.0.1:9/v1"
    for args in (("--token-file", str(token_file)), ("--config", str(config))):
        runs_log = tmp_path / "iop-node-runs.jsonl"
        with running(start_upstream_node(runs_log, down, *args)) as node:
            assert await statuses(node.address) == dict.fromkeys(RPCS, Status.UNAUTHENTICATED)
            allowed = await statuses(node.address, {"authorization": f"Bearer {TOKEN}"})
            assert allowed["Describe"] is Status.UNAVAILABLE
