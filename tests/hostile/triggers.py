"""The known one-packet inputs that ended the edge's process, as cases.

Each was reproduced against the edge with API keys on and no key sent:
an h2c upgrade with a broken HTTP2-Settings header, HTTP/2 DATA on a stream
the edge already answered (sent once the answer arrived), a flood of
PRIORITY frames for idle streams, a WebSocket upgrade request followed by
one more byte in the same packet.
"""

from __future__ import annotations

import base64

import hpack
from hyperframe.frame import DataFrame, HeadersFrame, PriorityFrame, SettingsFrame

from tests.hostile.h1 import settings_b64
from tests.hostile.h2 import PREFACE
from tests.hostile.wire import Case


def _h2c(settings: bytes) -> bytes:
    return (
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: " + settings + b"\r\n\r\n"
    )


def _h2_get(path: str) -> bytes:
    block = hpack.Encoder().encode(
        [(":method", "GET"), (":scheme", "http"), (":authority", "x"), (":path", path)]
    )
    return (
        PREFACE
        + SettingsFrame(0).serialize()
        + HeadersFrame(1, block, flags=["END_HEADERS"]).serialize()
    )


def triggers() -> list[Case]:
    """The one-packet triggers, in a fixed order."""
    ws = (
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    priorities = b"".join(
        PriorityFrame(2 * i + 1, depends_on=0, stream_weight=16).serialize() for i in range(1100)
    )
    cases = [
        ("h2c upgrade, HTTP2-Settings not base64", (_h2c(b"A"),)),
        ("h2c upgrade, HTTP2-Settings of 5 bytes", (_h2c(base64.urlsafe_b64encode(b"12345")),)),
        ("h2c upgrade, ENABLE_PUSH=7", (_h2c(settings_b64(0x2, 7)),)),
        ("h2c upgrade, INITIAL_WINDOW_SIZE=2^31", (_h2c(settings_b64(0x4, 2**31)),)),
        (
            "h2 DATA after the response (401 on /v1/models)",
            (_h2_get("/v1/models"), DataFrame(1, b"x", flags=["END_STREAM"]).serialize()),
        ),
        (
            "h2 DATA after the response (GET /healthz)",
            (_h2_get("/healthz"), DataFrame(1, b"x", flags=["END_STREAM"]).serialize()),
        ),
        (
            "h2 1,100 PRIORITY frames on idle streams",
            (PREFACE + SettingsFrame(0).serialize() + priorities,),
        ),
        ("WebSocket upgrade and one more byte, in one packet", (ws + b"x",)),
    ]
    return [Case("trigger", i, label, parts) for i, (label, parts) in enumerate(cases)]
