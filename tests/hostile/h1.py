"""Malformed HTTP/1.1 requests drawn from a seed.

Each case starts from a valid request (a GET, or a chat POST with a JSON
body) and applies one to three mutations: the request line, the headers
(duplicates, Content-Length with Transfer-Encoding, obsolete folding, bare
LF, NUL bytes, huge values), chunked framing (bad sizes, extensions,
trailers, missing terminators), upgrades (h2c with random or broken
HTTP2-Settings, WebSocket followed by more bytes), pipelining, or plain
binary junk. The same seed gives the same cases.
"""

from __future__ import annotations

import base64
import json
import random
import struct
from collections.abc import Callable

from tests.hostile.wire import Case

Request = tuple[bytes, list[tuple[bytes, bytes]], bytes]  # request line, headers, body

_BODY = json.dumps(
    {"model": "sim-echo", "messages": [{"role": "user", "content": "fuzz"}]}
).encode()


def _base(rng: random.Random, key: str) -> Request:
    auth = [(b"Authorization", f"Bearer {key}".encode())] if rng.random() < 0.7 else []
    if rng.random() < 0.4:
        target = rng.choice([b"/healthz", b"/v1/models", b"/readyz", b"/", b"/metrics"])
        return b"GET " + target + b" HTTP/1.1", [(b"Host", b"edge"), *auth], b""
    headers = [
        (b"Host", b"edge"),
        (b"Content-Type", b"application/json"),
        (b"Content-Length", str(len(_BODY)).encode()),
        *auth,
    ]
    return b"POST /v1/chat/completions HTTP/1.1", headers, _BODY


def settings_b64(setting: int, value: int) -> bytes:
    """One HTTP2-Settings entry, base64url without padding (as the header carries it)."""
    return base64.urlsafe_b64encode(struct.pack("!HI", setting, value)).rstrip(b"=")


def _settings_payload(rng: random.Random) -> bytes:
    """An HTTP2-Settings value: sometimes valid, often not."""
    choice = rng.randrange(6)
    if choice == 0:
        return b"A"  # not valid base64
    if choice == 1:
        return base64.urlsafe_b64encode(rng.randbytes(5))  # not a multiple of 6 bytes
    if choice == 2:
        return settings_b64(0x2, 7)  # ENABLE_PUSH=7
    if choice == 3:
        return settings_b64(0x4, 2**31)
    if choice == 4:
        return b"!!!" + rng.randbytes(3).hex().encode()
    return settings_b64(0x3, rng.randrange(2**32))


def _line(rng: random.Random, req: Request) -> Request:
    line, headers, body = req
    method, target, version = ([*line.split(b" ", 2), b"", b""])[:3]
    what = rng.randrange(6)
    if what == 0:
        method = rng.choice([b"", b"G\x00T", b"PRI", b"CONNECT", b"get", b"X" * 300, b"TRACE"])
    elif what == 1:
        target = rng.choice(
            [b"*", b"http://evil/v1/chat/completions", b"/v1//chat/completions", b"/%00",
             b"/" + b"a" * rng.choice([100, 9000, 70000]), b"/\x1b[31m", b"/%0Aforged", b""]
        )  # fmt: skip
    elif what == 2:
        version = rng.choice([b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9.9", b"", b"HTTP/1.1 extra"])
    elif what == 3:
        return method + b"  " + target + b"\t" + version, headers, body
    elif what == 4:
        return line.replace(b" ", b"", 1), headers, body
    else:
        return line + b"\r", headers, body
    return b" ".join(p for p in (method, target, version)), headers, body


def _headers(rng: random.Random, req: Request) -> Request:
    line, headers, body = req
    headers = list(headers)
    what = rng.randrange(10)
    if what == 0:
        headers.append((b"Content-Length", rng.choice([b"0", b"-1", b"99999999999", b"1x"])))
    elif what == 1:
        headers.append((b"Transfer-Encoding", rng.choice([b"chunked", b"gzip, chunked", b"x"])))
    elif what == 2:
        headers.append((b"X-Folded", b"a\r\n  folded continuation"))
    elif what == 3:
        headers.append((b"X-Bad\x00Name", b"v"))
    elif what == 4:
        headers.append((b"X-Big", b"b" * rng.choice([8000, 20000, 100000])))
    elif what == 5:
        headers += [(f"X-H{i}".encode(), b"v") for i in range(rng.choice([100, 500, 2000]))]
    elif what == 6:
        headers.append((b"Host ", b"space-before-colon"))
    elif what == 7:
        headers.append((b"NoColonHeader", b""))
    elif what == 8:
        headers.append((b"Authorization", rng.choice([b"bearer x", b"Bearer", b"Basic \xff\xfe"])))
    else:
        headers.append((b"Expect", b"100-continue"))
    return line, headers, body


def _chunked(rng: random.Random, req: Request) -> Request:
    line, headers, body = req
    headers = [(k, v) for k, v in headers if k != b"Content-Length"]
    if rng.random() < 0.5:
        headers.append((b"Content-Length", str(len(body)).encode()))  # CL and TE together
    headers.append((b"Transfer-Encoding", b"chunked"))
    size = f"{len(body):x}".encode()
    chunk = rng.choice(
        [
            size + b"\r\n" + body + b"\r\n0\r\n\r\n",
            b"zz\r\n" + body + b"\r\n0\r\n\r\n",
            b"ffffffffffffffff\r\n" + body,
            size + b";ext=" + b"e" * 5000 + b"\r\n" + body + b"\r\n0\r\n\r\n",
            size + b"\r\n" + body + b"\r\n0\r\nX-Trailer: t\r\n\r\n",
            size + b"\r\n" + body + b"0\r\n\r\n",
            b"-1\r\n" + body + b"\r\n0\r\n\r\n",
            size + b"\n" + body + b"\n0\n\n",
        ]
    )
    return line, headers, chunk


def _with(req: Request, *extra: tuple[bytes, bytes]) -> Request:
    line, headers, body = req
    return line, [*headers, *extra], body


def _upgrade_h2c(rng: random.Random, req: Request) -> Request:
    return _with(
        req,
        (b"Connection", b"Upgrade, HTTP2-Settings"),
        (b"Upgrade", b"h2c"),
        (b"HTTP2-Settings", _settings_payload(rng)),
    )


def _upgrade_ws(rng: random.Random, req: Request) -> Request:
    return _with(
        req,
        (b"Connection", b"Upgrade"),
        (b"Upgrade", b"websocket"),
        (b"Sec-WebSocket-Key", base64.b64encode(rng.randbytes(16))),
        (b"Sec-WebSocket-Version", b"13"),
    )


_MUTATIONS: tuple[Callable[[random.Random, Request], Request], ...] = (
    _line,
    _headers,
    _headers,
    _chunked,
    _upgrade_h2c,
    _upgrade_ws,
)


def _serialize(rng: random.Random, req: Request) -> bytes:
    line, headers, body = req
    eol = b"\n" if rng.random() < 0.05 else b"\r\n"
    head = line + eol + b"".join(k + b": " + v + eol for k, v in headers) + eol
    return head + body


def h1_case(rng: random.Random, index: int, key: str) -> Case:
    """One malformed HTTP/1.1 case (deterministic in `rng`'s state)."""
    roll = rng.random()
    if roll < 0.08:
        return Case("h1", index, "binary junk", (rng.randbytes(rng.choice([1, 16, 512, 4096])),))
    req = _base(rng, key)
    names = []
    for _ in range(rng.randint(1, 3)):
        mutation = rng.choice(_MUTATIONS)
        names.append(mutation.__name__.lstrip("_"))
        req = mutation(rng, req)
    data = _serialize(rng, req)
    parts: tuple[bytes, ...] = (data,)
    if "upgrade_ws" in names or rng.random() < 0.15:
        tail = rng.choice([b"x", rng.randbytes(rng.randint(1, 64)), data])
        if rng.random() < 0.5:
            parts = (data + tail,)  # in the same packet
            names.append("more bytes")
        else:
            parts = (data, tail)  # once the edge answered (or upgraded)
            names.append("then more bytes")
    if rng.random() < 0.1:
        parts = (parts[0] + _serialize(rng, _base(rng, key)), *parts[1:])
        names.append("pipelined")
    return Case("h1", index, " + ".join(names), parts)
