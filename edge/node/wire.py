"""A RunRequest serialized by hand, straight from the caller's request.

betterproto2 spends ~75 us serializing one RunRequest (a `warnings` context
per default field); this writes the same protobuf in ~10 us. It follows
`protos/iop/node/v1/node.proto` field by field: proto3 scalars are left out
at their default, `optional` fields are written whenever set. A property
test holds it to betterproto2's reading of the same request.
"""

from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING

from edge.node.convert import extra_json, tool_choice

if TYPE_CHECKING:
    from edge.api.request import ChatMessage, ChatRequest

_pack_double = struct.Struct("<d").pack


class EncodedRunRequest(bytes):
    """RunRequest bytes; grpclib's codec sends them as they are."""

    run_id: str

    def SerializeToString(self) -> bytes:  # the protobuf method grpclib's codec calls
        return bytes(self)


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64: two's complement, ten bytes
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _str(field: int, value: str | None, *, optional: bool = False) -> bytes:
    """A string field: left out when empty, unless `optional` and set."""
    if value is None or (not value and not optional):
        return b""
    return _len(field, value.encode())


def _double(field: int, value: float | None) -> bytes:
    return b"" if value is None else _varint(field << 3 | 1) + _pack_double(value)


def _uint(field: int, value: int | None, *, optional: bool = False) -> bytes:
    if value is None or (not value and not optional):
        return b""
    return _varint(field << 3) + _varint(value)


def _bool(field: int, value: bool | None, *, optional: bool = False) -> bytes:
    if value is None or (not value and not optional):
        return b""
    return _varint(field << 3) + (b"\x01" if value else b"\x00")


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _part_json(kind: str, raw: object) -> str:
    return "" if kind == "text" else _compact(raw)


def _message(msg: ChatMessage) -> bytes:
    parts = b"".join(
        _len(3, _str(1, p.type) + _str(2, p.text) + _str(3, _part_json(p.type, p.raw)))
        for p in msg.parts
    )
    calls = b"".join(
        _len(6, _str(1, c.id) + _str(2, c.type) + _str(3, c.name) + _str(4, c.arguments))
        for c in msg.tool_calls
    )
    return (
        _str(1, msg.role)
        + _str(2, msg.content, optional=True)
        + parts
        + _str(4, msg.name)
        + _str(5, msg.tool_call_id)
        + calls
        + _str(7, msg.reasoning_content, optional=True)
    )


def encode_run_request(
    request: ChatRequest, *, run_id: str, model: str, deadline_unix_ms: int = 0
) -> EncodedRunRequest:
    """The RunRequest `edge.node.convert.run_request_from_chat` builds, as bytes."""
    policy = request.tools
    tools = b"".join(
        _len(
            4,
            _str(1, "function")
            + _str(2, t.name)
            + _str(3, t.description)
            + _str(4, "" if t.parameters is None else _compact(t.parameters))
            + _bool(5, t.strict, optional=True),
        )
        for t in policy.tools
    )
    metadata = b"".join(
        _len(15, _str(1, key) + _str(2, value)) for key, value in request.metadata.items()
    )
    encoded = EncodedRunRequest(
        _str(1, run_id)
        + _str(2, model)
        + b"".join(_len(3, _message(m)) for m in request.messages)
        + tools
        + _str(5, tool_choice(request))
        + _bool(6, policy.parallel_tool_calls if policy.tools else None, optional=True)
        + _double(7, request.temperature)
        + _double(8, request.top_p)
        + _uint(9, request.max_tokens, optional=True)
        + b"".join(_len(10, s.encode()) for s in request.stop)
        + _uint(11, request.seed, optional=True)
        + _double(12, request.presence_penalty)
        + _double(13, request.frequency_penalty)
        + _str(14, "" if request.response_format is None else _compact(request.response_format))
        + metadata
        + _uint(16, deadline_unix_ms)
        + _bool(17, request.include_reasoning)
        + _str(18, extra_json(request))
    )
    encoded.run_id = run_id
    return encoded
