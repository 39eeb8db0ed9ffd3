"""The codec both sides of the node contract build on: grpclib's protobuf codec with
the one check of a received message's size, and messages serialized ahead of time.

- `ContractCodec.decode` refuses a received message over MAX_MESSAGE_BYTES
  (gRPC's default limit, at the edge and at every node) before it is parsed.
  grpclib 0.4.9 (the latest release) has no receive limit of its own
  (vmagamedov/grpclib#195, open): it reads a message's length prefix and
  then the whole message before any hook of ours runs, so the codec is the
  first public place that sees it. What the refused message becomes is each
  side's (`refuse`): the edge answers it with a value, a node ends the RPC.
- `Serialized`: a message the generated code serialized already (once, for
  every attempt of a request or every repeat of an event); `ContractCodec.encode`
  sends its bytes as they are, whatever message type the stream carries.
  `Encoded` is the plain form, a message's bytes.

It knows the contract's limit and grpclib's codec interface only: not who
sends, nor what either side does with a refusal.
"""

from __future__ import annotations

from typing import Any

from grpclib.encoding.proto import ProtoCodec

from edge.contract.routes import MAX_MESSAGE_BYTES

__all__ = ["ContractCodec", "Encoded", "Serialized"]


class Serialized:
    """A message serialized already: `ContractCodec` sends `SerializeToString()` as it is."""

    __slots__ = ()

    def SerializeToString(self) -> bytes:  # the protobuf method grpclib's codec calls
        raise NotImplementedError


class Encoded(bytes, Serialized):
    """A message's bytes, serialized once by the generated code: a node that sends the
    same event many times pays for its serialization once."""

    def SerializeToString(self) -> bytes:
        return self


class ContractCodec(ProtoCodec):
    """grpclib's protobuf codec: `Serialized` messages go out as their bytes; a received
    message over MAX_MESSAGE_BYTES is `refuse`d, unparsed."""

    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, Serialized):
            return message.SerializeToString()
        return super().encode(message, message_type)

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > MAX_MESSAGE_BYTES:
            return self.refuse(len(data))
        return super().decode(data, message_type)

    def refuse(self, size: int) -> Any:
        """What a received message of `size` bytes, over the limit, becomes: raise to end
        the RPC, or return what the reader gets in its place."""
        raise NotImplementedError
