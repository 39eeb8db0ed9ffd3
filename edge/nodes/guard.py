"""A node's door: the bearer token every RPC must carry, and TLS (mutual with a client CA).

- `--token-file FILE`: every RPC (Run, CancelRun, Describe, Watch, any other) must
  carry the metadata `authorization: Bearer <token>`; one without it, or with another
  token, ends UNAUTHENTICATED before its handler runs (grpclib's `RecvRequest` server
  event). Tokens are compared in constant time (`hmac.compare_digest`).
- `--tls-cert FILE --tls-key FILE`: the node serves TLS (HTTP/2 by ALPN);
  `--tls-client-ca FILE` makes it mutual: a client must show a certificate that CA
  signed, or the handshake fails.
- SIGHUP reads the files again (`NodeGuard.reload`): the new token applies to the next
  RPC, the new certificate chain to the next handshake (loaded into the same
  SSLContext); a file that cannot be read keeps the old one and says why.
- A node asked to listen on an address other than loopback with neither a token nor
  TLS refuses to start (`refusal`), unless `--insecure` says that is wanted.

Node side only (asyncio, grpclib); knows nothing of runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import signal
import ssl
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from edge.config.address import is_loopback

AUTHORIZATION = "authorization"
BEARER = "Bearer "


class GuardError(Exception):
    """A credential file that cannot be used; the message is one line."""


@dataclass(frozen=True, slots=True)
class GuardSettings:
    """Where a node's credentials are read from (none: the door is open)."""

    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    insecure: bool = False

    @property
    def locked(self) -> bool:
        """A token or TLS is asked for."""
        return self.token_file is not None or self.tls_cert is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `GuardSettings`, the same on every node's command."""
    parser.add_argument(
        "--token-file", type=Path, metavar="FILE",
        help="every RPC must carry 'authorization: Bearer <the file's token>' (re-read on SIGHUP)",
    )  # fmt: skip
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help="serve TLS: its certificate")
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="serve TLS: private key")
    parser.add_argument(
        "--tls-client-ca", type=Path, metavar="FILE",
        help="mutual TLS: require a client certificate signed by this CA",
    )  # fmt: skip
    parser.add_argument(
        "--insecure", action="store_true",
        help="serve an address other than loopback with neither token nor TLS",
    )  # fmt: skip


def settings_from(
    args: argparse.Namespace, table: Mapping[str, object] | None = None
) -> GuardSettings:
    """The flags as settings, each unset one taken from `table` (a node's config file:
    `token_file`, `tls_cert`, `tls_key`, `tls_client_ca`, `insecure`); raises
    GuardError for a half-given TLS pair."""
    table = table or {}

    def path(key: str) -> Path | None:
        value = getattr(args, key) or table.get(key)
        return Path(str(value)) if value else None

    settings = GuardSettings(
        token_file=path("token_file"),
        tls_cert=path("tls_cert"),
        tls_key=path("tls_key"),
        tls_client_ca=path("tls_client_ca"),
        insecure=bool(args.insecure or table.get("insecure", False)),
    )
    if (settings.tls_cert is None) != (settings.tls_key is None):
        raise GuardError("--tls-cert and --tls-key go together")
    if settings.tls_client_ca is not None and settings.tls_cert is None:
        raise GuardError("--tls-client-ca needs --tls-cert and --tls-key")
    return settings


def refusal(settings: GuardSettings, host: str, port: int) -> str | None:
    """Why a node must not listen on host:port with these settings (None: it may)."""
    if settings.locked or settings.insecure or is_loopback(host):
        return None
    return (
        f"refusing to serve {host}:{port} to anyone who reaches it: give --token-file FILE"
        " and/or --tls-cert FILE --tls-key FILE (--tls-client-ca FILE for mutual TLS),"
        " or --insecure to serve it open"
    )


def read_token(path: Path) -> bytes:
    """The token a file holds (surrounding whitespace dropped); raises GuardError."""
    try:
        token = path.read_bytes().strip()
    except OSError as exc:
        raise GuardError(f"token file {path}: {exc.strerror or exc}") from None
    if not token:
        raise GuardError(f"token file {path} is empty")
    return token


class NodeGuard:
    """The credentials of one node process, shared by its servers, read again on SIGHUP."""

    def __init__(self, settings: GuardSettings) -> None:
        """Reads every file once; raises GuardError when one cannot be used."""
        self.settings = settings
        self._token: bytes | None = None
        # The server's SSLContext (None: plaintext); a reload loads into this one.
        self.ssl: ssl.SSLContext | None = None
        if settings.tls_cert is not None:
            # A bare server context: it trusts no CA (the system's are not loaded), so
            # with --tls-client-ca only that CA's certificates are taken.
            self.ssl = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.ssl.minimum_version = ssl.TLSVersion.TLSv1_2
            self.ssl.set_alpn_protocols(["h2"])
            if settings.tls_client_ca is not None:
                self.ssl.verify_mode = ssl.CERT_REQUIRED
        self.load()

    def load(self) -> None:
        """Read the files into the running state; raises GuardError (then nothing
        changed but a certificate chain or CA loaded before the failing file)."""
        s = self.settings
        token = read_token(s.token_file) if s.token_file is not None else None
        if self.ssl is not None:
            assert s.tls_cert is not None
            assert s.tls_key is not None
            try:
                self.ssl.load_cert_chain(s.tls_cert, s.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise GuardError(f"--tls-cert {s.tls_cert}, --tls-key {s.tls_key}: {exc}") from None
            if s.tls_client_ca is not None:
                # Adds the CA to those trusted: a CA rotated in stays trusted beside the
                # old one until the node restarts.
                try:
                    self.ssl.load_verify_locations(cafile=s.tls_client_ca)
                except (OSError, ssl.SSLError) as exc:
                    raise GuardError(f"--tls-client-ca {s.tls_client_ca}: {exc}") from None
        self._token = token

    def reload(self) -> str:
        """`load`, for SIGHUP: the line that says how it went."""
        try:
            self.load()
        except GuardError as exc:
            return f"credentials not reloaded, the old ones serve on: {exc}"
        return "credentials reloaded"

    def allows(self, metadata_value: object) -> bool:
        """Whether an RPC's `authorization` metadata carries the token (True: no token)."""
        if self._token is None:
            return True
        if not isinstance(metadata_value, str):
            return False
        return hmac.compare_digest(metadata_value.encode(), BEARER.encode() + self._token)

    async def _check(self, event: RecvRequest) -> None:
        if not self.allows(event.metadata.get(AUTHORIZATION)):
            raise GRPCError(Status.UNAUTHENTICATED, "missing or wrong bearer token")

    def attach(self, server: Server) -> None:
        """Check every RPC `server` receives (a no-op without a token file)."""
        if self.settings.token_file is not None:
            listen(server, RecvRequest, self._check)

    def reload_on_sighup(self, prog: str) -> None:
        """Read the files again on each SIGHUP, saying how it went on stdout (a line per
        signal). Without a file to read, SIGHUP keeps its default."""
        if not self.settings.locked:
            return

        def reload() -> None:
            print(f"{prog}: {self.reload()}", flush=True)

        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)


def start_guard(settings: GuardSettings, host: str, port: int) -> NodeGuard | str:
    """The guard a node serves host:port with (its files read), or the one line saying
    why it must not start: an unusable file, or an address open to others without
    credentials."""
    why = refusal(settings, host, port)
    if why is not None:
        return why
    try:
        return NodeGuard(settings)
    except GuardError as exc:
        return str(exc)


def say_refused(prog: str, why: str) -> int:
    """Print `why` as the command's one line on stderr; the exit status."""
    print(f"{prog}: {why}", file=sys.stderr, flush=True)
    return 2
