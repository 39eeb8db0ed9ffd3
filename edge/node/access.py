"""How the edge proves itself to a node: the bearer token and the TLS of its connections.

`NodeAccess` is what one node's connections carry: the token sent as the metadata
`authorization: Bearer <token>` on every call (Run, CancelRun, Describe, Watch),
through grpclib's `SendRequest` channel event, and the SSLContext of TLS (with the
edge's client certificate for mutual TLS, and the name to verify when it is not the
host's). `client_ssl_context` builds that context from files.

Knows nothing of the configuration's shape: the process layer reads `[[nodes]]` into
a `NodeAccess`.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from grpclib.events import SendRequest

AUTHORIZATION = "authorization"


@dataclass(frozen=True, slots=True)
class NodeAccess:
    """The credentials of one node's connections (the defaults: plaintext, no token)."""

    token: str | None = field(default=None, repr=False)
    ssl: ssl.SSLContext | None = None
    # The name the node's certificate must carry, when it is not the address's host.
    server_name: str | None = None

    @property
    def locked(self) -> bool:
        return self.token is not None or self.ssl is not None

    async def authorize(self, event: SendRequest) -> None:
        """The `SendRequest` event of a channel: the call carries the token."""
        if self.token is not None:
            event.metadata[AUTHORIZATION] = f"Bearer {self.token}"


def client_ssl_context(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """TLS to a node: its certificate checked against `ca_file` (None: the system's CAs),
    HTTP/2 by ALPN, and the edge's own certificate when `cert_file` is given (mutual TLS;
    `key_file` None: the key is in `cert_file`). Raises OSError or ssl.SSLError."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context
