"""`[[nodes]]` credentials: the token file and TLS settings, read when the configuration
is, so that a file that cannot be used is the configuration's error (a reload with it
is refused, edge.process.reload); and the node's own door (edge.nodes.guard)."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

import pytest
import trustme
from loguru import logger

from edge.config import ConfigError, NodeConfig, parse_config
from edge.config.address import is_loopback
from edge.node.backlog import Backlog
from edge.node.bridge import asyncio_loop
from edge.nodes.guard import (
    GuardError,
    GuardSettings,
    NodeGuard,
    add_arguments,
    refusal,
    settings_from,
    start_guard,
)
from edge.observe.metrics import EdgeMetrics
from edge.process.nodeset import NodeSet, node_access


def _node(tmp_path: Path, **entry: object) -> NodeConfig:
    source = str(tmp_path / "edge.toml")
    return parse_config({"nodes": [{"address": "10.0.0.5:50051", **entry}]}, source).nodes[0]


def test_a_token_file_is_read_beside_the_config_file(tmp_path: Path) -> None:
    """A relative token_file is the config file's neighbour; the token goes on every
    call as `Bearer <token>`, whitespace around it dropped; no TLS unless asked."""
    (tmp_path / "node.token").write_text("  abc  \n")
    node = _node(tmp_path, token_file="node.token")
    assert node.token_file == str(tmp_path / "node.token")
    assert not node.tls
    access = node_access(node)
    assert access.token == "abc"
    assert access.ssl is None


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"token_file": "missing.token"}, "nodes[0].token_file: cannot read"),
        ({"token_file": "empty.token"}, "nodes[0].token_file:"),
        ({"ca_file": "missing.pem"}, "nodes[0].ca_file: cannot read"),
        ({"key_file": "empty.token"}, "nodes[0].key_file: needs cert_file"),
        ({"cert_file": "empty.token"}, "nodes[0].cert_file: cannot load"),
        ({"tls": "yes"}, "nodes[0].tls"),
    ],
)
def test_a_file_that_cannot_be_used_is_a_config_error(
    tmp_path: Path, entry: dict[str, object], message: str
) -> None:
    """A missing or empty token file, a missing CA, a key without its certificate, a
    certificate that does not load: one line naming the key."""
    (tmp_path / "empty.token").write_text("\n")
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _node(tmp_path, **entry)


def test_tls_is_implied_by_its_files_and_a_changed_file_reconnects(tmp_path: Path) -> None:
    """ca_file (or cert_file, or server_name) turns TLS on; a file whose content changed
    makes the node's connection differ (a reload connects it again)."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "node.token").write_text("one")
    first = _node(tmp_path, ca_file="ca.pem", token_file="node.token", server_name="n.internal")
    assert first.tls
    access = node_access(first)
    assert access.ssl is not None
    assert access.server_name == "n.internal"
    assert _node(tmp_path, ca_file="ca.pem", token_file="node.token") != first
    (tmp_path / "node.token").write_text("two")
    again = _node(tmp_path, ca_file="ca.pem", token_file="node.token", server_name="n.internal")
    assert again.connection != first.connection


def test_a_node_served_in_process_takes_no_credentials(tmp_path: Path) -> None:
    (tmp_path / "node.token").write_text("t")
    with pytest.raises(ConfigError, match="in-process"):
        parse_config(
            {"nodes": [{"address": "embedded", "token_file": "node.token"}]},
            str(tmp_path / "edge.toml"),
        )


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("node.internal", False)],
)  # fmt: skip
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_node_open_beyond_loopback_is_refused_unless_locked_or_insecure() -> None:
    """Loopback is open by default; another address needs a token, TLS or --insecure."""
    assert refusal(GuardSettings(), "127.0.0.1", 1) is None
    why = refusal(GuardSettings(), "0.0.0.0", 1)
    assert why is not None
    assert "--token-file" in why
    assert "--insecure" in why
    assert refusal(GuardSettings(insecure=True), "0.0.0.0", 1) is None
    assert refusal(GuardSettings(token_file=Path("t")), "0.0.0.0", 1) is None


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_the_guard_flags_are_checked_before_the_node_starts(tmp_path: Path) -> None:
    """A TLS flag without its pair, or a token file that cannot be read: one line."""
    with pytest.raises(GuardError, match="go together"):
        settings_from(_args("--tls-cert", "c.pem"))
    settings = settings_from(_args("--tls-key", "k.pem"), {"tls_cert": "c.pem"})
    assert settings.tls_cert == Path("c.pem")
    token_file = settings_from(_args(), {"token_file": str(tmp_path / "none")})
    missing = start_guard(token_file, "127.0.0.1", 1)
    assert isinstance(missing, str)
    assert "token file" in missing


def test_the_guard_takes_the_token_and_no_other(tmp_path: Path) -> None:
    """Only `Bearer <token>` passes, compared whole; a reload takes a new token, and one
    that fails keeps the old."""
    token = tmp_path / "node.token"
    token.write_text("abc\n")
    guard = NodeGuard(GuardSettings(token_file=token))
    assert guard.allows("Bearer abc")
    for wrong in (None, "abc", "Bearer ab", "Bearer abcd", "bearer abc", "Bearer é"):
        assert not guard.allows(wrong)
    token.write_text("xyz")
    assert guard.reload() == "credentials reloaded"
    assert guard.allows("Bearer xyz")
    token.unlink()
    assert "not reloaded" in guard.reload()
    assert guard.allows("Bearer xyz")
    assert NodeGuard(GuardSettings()).allows(None)


async def test_a_node_open_over_the_network_is_named_in_a_warning(tmp_path: Path) -> None:
    """Opening a node reached over a non-loopback address with neither TLS nor a token
    logs a warning naming it; one with a token, or on loopback, does not."""
    (tmp_path / "node.token").write_text("t")
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), format="{message}")
    nodes = NodeSet(metrics=EdgeMetrics(), backlog=Backlog())
    try:
        async with asyncio_loop():  # the clients close on it
            for node in (
                NodeConfig("far-open", "10.255.255.1:50051"),
                _node(tmp_path, name="far-locked", token_file="node.token"),
                NodeConfig("near", "127.0.0.1:50051"),
            ):
                opened = await nodes.open_node(node)
                await opened.stack.aclose()
    finally:
        logger.remove(sink)
    warned = [line for line in lines if "neither TLS nor a token" in line]
    assert len(warned) == 1
    assert "far-open" in warned[0]


def test_mutual_tls_trusts_the_client_ca_only(tmp_path: Path) -> None:
    """The node's TLS context requires a client certificate and trusts the client CA
    alone, none of the system's CAs."""
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "node.pem")
    )
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    pem = tmp_path / "node.pem"
    guard = NodeGuard(GuardSettings(tls_cert=pem, tls_key=pem, tls_client_ca=tmp_path / "ca.pem"))
    assert guard.ssl is not None
    assert guard.ssl.verify_mode is ssl.CERT_REQUIRED
    assert len(guard.ssl.get_ca_certs()) == 1
    server_only = NodeGuard(GuardSettings(tls_cert=pem, tls_key=pem)).ssl
    assert server_only is not None
    assert server_only.get_ca_certs() == []
