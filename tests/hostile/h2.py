"""Random HTTP/2 (prior knowledge) frame sequences drawn from a seed, built with hyperframe.

Each case is the client preface and SETTINGS, then a few steps: valid
requests (HEADERS with HPACK from `hpack`), and frames a peer must not send
or that stress the server: DATA on idle or closed streams or after the
response, PRIORITY floods on idle streams, SETTINGS with out-of-range
values, WINDOW_UPDATE overflow or zero, RST_STREAM on idle streams, HEADERS
with undecodable HPACK, CONTINUATION without HEADERS, GOAWAY, PING floods,
unknown frame types. A step can be a separate part (sent after the edge
answered the previous one). The same seed gives the same cases.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable

import hpack
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from tests.hostile.wire import Case

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_BODY = json.dumps(
    {"model": "sim-echo", "messages": [{"role": "user", "content": "h2 fuzz"}]}
).encode()


class _Conn:
    """The client side's stream ids and HPACK state for one case."""

    def __init__(self, rng: random.Random, key: str) -> None:
        self.rng = rng
        self.key = key
        self.encoder = hpack.Encoder()
        self.next_id = 1
        self.opened: list[int] = []

    def new_stream(self) -> int:
        sid = self.next_id
        self.next_id += 2
        self.opened.append(sid)
        return sid

    def some_stream(self) -> int:
        """An opened stream, an idle one, or stream 0."""
        roll = self.rng.random()
        if self.opened and roll < 0.5:
            return self.rng.choice(self.opened)
        if roll < 0.9:
            return self.next_id + 2 * self.rng.randrange(50)
        return 0


def _ser(*frames: Frame) -> bytes:
    return b"".join(f.serialize() for f in frames)


def _on_stream(frame: bytes, sid: int) -> bytes:
    """`frame` (one serialized frame) moved to stream `sid`, 0 included (hyperframe refuses
    to build DATA, HEADERS, ... on stream 0)."""
    return frame[:5] + struct.pack("!I", sid) + frame[9:]


def _request(c: _Conn) -> bytes:
    sid = c.new_stream()
    auth = [("authorization", f"Bearer {c.key}")] if c.rng.random() < 0.7 else []
    if c.rng.random() < 0.5:
        path = c.rng.choice(["/healthz", "/v1/models", "/nope"])
        block = c.encoder.encode(
            [
                (":method", "GET"),
                (":scheme", "http"),
                (":authority", "edge"),
                (":path", path),
                *auth,
            ]
        )
        # Without END_STREAM the stream stays open on our side once the edge answered it.
        flags = ["END_HEADERS", "END_STREAM"] if c.rng.random() < 0.5 else ["END_HEADERS"]
        return _ser(HeadersFrame(sid, block, flags=flags))
    block = c.encoder.encode(
        [(":method", "POST"), (":scheme", "http"), (":authority", "edge"),
         (":path", "/v1/chat/completions"), ("content-type", "application/json"), *auth]
    )  # fmt: skip
    frames: list[Frame] = [HeadersFrame(sid, block, flags=["END_HEADERS"])]
    if c.rng.random() < 0.8:
        frames.append(DataFrame(sid, _BODY, flags=["END_STREAM"]))
    return _ser(*frames)


def _data(c: _Conn) -> bytes:
    flags = ["END_STREAM"] if c.rng.random() < 0.5 else []
    payload = c.rng.randbytes(c.rng.choice([0, 1, 100]))
    # Mostly on the last request's stream: DATA after (or before) the edge answered it.
    sid = c.opened[-1] if c.opened and c.rng.random() < 0.6 else c.some_stream()
    return _on_stream(_ser(DataFrame(1, payload, flags=flags)), sid)


def _priority_flood(c: _Conn) -> bytes:
    n = c.rng.choice([50, 1100, 3000])
    frames = []
    for i in range(n):
        sid = c.next_id + 2 * i
        dep = 0 if c.rng.random() < 0.7 else c.rng.randrange(0, 1000)
        if dep == sid:
            dep = 0
        frames.append(PriorityFrame(sid, depends_on=dep, stream_weight=c.rng.randrange(256)))
    if c.rng.random() < 0.1:  # one stream depending on itself (a protocol error) at the end
        frames.append(PriorityFrame(c.next_id, depends_on=c.next_id))
    return _ser(*frames)


def _settings(c: _Conn) -> bytes:
    bad = c.rng.choice(
        [
            {SettingsFrame.ENABLE_PUSH: 7},
            {SettingsFrame.INITIAL_WINDOW_SIZE: 2**31},
            {SettingsFrame.MAX_FRAME_SIZE: 1},
            {SettingsFrame.MAX_FRAME_SIZE: 2**24},
            {SettingsFrame.HEADER_TABLE_SIZE: 2**32 - 1},
            {SettingsFrame.MAX_CONCURRENT_STREAMS: 0},
            {0x99: 1},
        ]
    )
    frame = SettingsFrame(0, settings=bad)
    if c.rng.random() < 0.2:
        return _ser(SettingsFrame(0, flags=["ACK"])) + struct.pack("!HI", 1, 1)[:3]
    return _ser(frame)


def _window_update(c: _Conn) -> bytes:
    sid = c.some_stream()
    inc = c.rng.choice([0, 2**31 - 1, 1])
    frame = _ser(WindowUpdateFrame(sid, window_increment=max(inc, 1)))
    if inc == 0:  # hyperframe refuses a zero increment: write it in the payload
        frame = frame[:9] + struct.pack("!I", 0)
    return frame * c.rng.choice([1, 2])


def _rst(c: _Conn) -> bytes:
    return _on_stream(_ser(RstStreamFrame(1, error_code=c.rng.randrange(16))), c.some_stream())


def _bad_hpack(c: _Conn) -> bytes:
    block = c.rng.choice([c.rng.randbytes(c.rng.randint(1, 64)), b"\xff" * 8, b"\x3f\xe1\xff\xff"])
    return _ser(HeadersFrame(c.new_stream(), block, flags=["END_HEADERS", "END_STREAM"]))


def _continuation(c: _Conn) -> bytes:
    frame = _ser(ContinuationFrame(1, c.rng.randbytes(8), flags=["END_HEADERS"]))
    return _on_stream(frame, c.some_stream())


def _goaway(c: _Conn) -> bytes:
    return _ser(GoAwayFrame(0, last_stream_id=c.rng.randrange(10), error_code=c.rng.randrange(3)))


def _ping_flood(c: _Conn) -> bytes:
    return _ser(
        *(PingFrame(0, opaque_data=struct.pack("!Q", i)) for i in range(c.rng.choice([10, 1000])))
    )


def _raw(c: _Conn) -> bytes:
    """A frame header hyperframe would not build: unknown type, huge length, odd stream."""
    length = c.rng.choice([0, 5, 2**24 - 1])
    ftype = c.rng.choice([0x0A, 0xFF, 0x1, 0x0])
    header = struct.pack("!I", length)[1:] + bytes([ftype, c.rng.randrange(256)])
    return header + struct.pack("!I", c.rng.randrange(2**32)) + c.rng.randbytes(min(length, 32))


_STEPS: tuple[Callable[[_Conn], bytes], ...] = (
    _request, _request, _data, _priority_flood, _settings, _window_update, _rst, _bad_hpack,
    _continuation, _goaway, _ping_flood, _raw,
)  # fmt: skip


def h2_case(rng: random.Random, index: int, key: str) -> Case:
    """One HTTP/2 frame sequence (deterministic in `rng`'s state)."""
    c = _Conn(rng, key)
    first = PREFACE + _ser(SettingsFrame(0, settings={SettingsFrame.ENABLE_PUSH: 0}))
    parts = [first]
    names = []
    for _ in range(rng.randint(1, 4)):
        step = rng.choice(_STEPS)
        names.append(step.__name__.lstrip("_"))
        data = step(c)
        if rng.random() < 0.4:
            parts.append(data)  # sent once the edge answered what came before
        else:
            parts[-1] += data
    return Case("h2", index, " + ".join(names), tuple(parts))


def stalled_streams(key: str, body: bytes, count: int) -> bytes:
    """One HTTP/2 connection's bytes: the preface, SETTINGS with a stream window of 0 (the
    edge may send no DATA on any stream until the client opens it, which it never does),
    then `count` POSTs of `body` to /v1/chat/completions."""
    encoder = hpack.Encoder()
    frames: list[Frame] = [SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 0})]
    for i in range(count):
        sid = 1 + 2 * i
        block = encoder.encode(
            [(":method", "POST"), (":scheme", "http"), (":authority", "edge"),
             (":path", "/v1/chat/completions"), ("content-type", "application/json"),
             ("authorization", f"Bearer {key}")]
        )  # fmt: skip
        frames.append(HeadersFrame(sid, block, flags=["END_HEADERS"]))
        for at in range(0, len(body), 2**14):
            flags = ["END_STREAM"] if at + 2**14 >= len(body) else []
            frames.append(DataFrame(sid, body[at : at + 2**14], flags=flags))
    return PREFACE + _ser(*frames)
