"""A RunRequest as the bytes sent to a node, serialized by the generated code.

The edge serializes a request's RunRequest once, before its first attempt
and off the event loop (`prepare_run_request`, in the request's parse
thread): the size is then known (a request over the nodes' gRPC message
limit is refused before any node is asked), every attempt of the request
sends the same bytes, and grpclib's codec sends them as they are. The bytes
come from `edge.node.convert.run_request_from_chat` and betterproto2, so a
field added to `protos/` is written by the generated code alone.

The same step takes the request's prefix fingerprint (`edge.api.fingerprint`,
with the contract's block size and bound): its hashes go into the RunRequest
(`prefix_blocks`, `prompt_chars`) and stay with the prepared request
(`PreparedRunRequest.prefix`) for the pool's pick under the cache-aware
policy.

One field differs between attempts: `deadline_unix_ms`, the request's total
deadline as wall-clock time when the attempt starts. The bytes are
serialized without it and each attempt's deadline is appended as the field
alone (`PreparedRunRequest.attempt`): a parser takes the last occurrence of
a scalar field in the bytes (the protobuf encoding's rule for a field that
appears more than once), and it appears once here.

A run that continues an answer another node started (`edge.fleet.migration`)
sends the request's bytes with a `continuation` field appended the same way
(`PreparedRunRequest.continued`, off the loop: the field holds the answer so
far): the request's bytes hold no such field, so it appears once.

The generated code writes the request (an attempt's deadline, one varint
field, is written by hand: `deadline_field`): a hand-written encoder takes ~20 us against
betterproto2's ~135 us per request in isolation, but end to end, A/B in one
sitting (8 rounds a variant at 200 non-streaming req/s), the edge spent a
median 2,427 us of CPU per request with one and 2,423 us without: the ~115 us
is under 5% of a request and lost in the run-to-run spread, far from the 10%
a hand-written path has to earn.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from edge.api.fingerprint import Fingerprint, fingerprint
from edge.contract._proto.iop.node import v1 as pb
from edge.contract.codec import Serialized
from edge.contract.prefix import MAX_PREFIX_BLOCKS, PREFIX_BLOCK_CHARS
from edge.contract.routes import MAX_MESSAGE_BYTES
from edge.errors import PayloadTooLargeError
from edge.node.convert import run_request_from_chat

if TYPE_CHECKING:
    from edge.api.request import ChatRequest


# An attempt's deadline is its own field after the request's bytes: `deadline_unix_ms`,
# field 16, a varint (tag 16 << 3 | 0, itself a varint: 0x80 0x01), as the generated
# code writes it (`tests/unit/test_wire.py` holds them equal). Written here, on the
# loop as each attempt starts: the generated code takes ~40 us for it, checking each
# of the RunRequest's fields against its default.
_DEADLINE_TAG = b"\x80\x01"
_U64 = 2**64 - 1
# The most bytes an attempt's deadline adds: its tag and a varint of up to 10 bytes
# (a negative int64).
DEADLINE_ROOM = len(_DEADLINE_TAG) + 10
_U32 = 2**32 - 1


def deadline_field(deadline_unix_ms: int) -> bytes:
    """The RunRequest bytes of `deadline_unix_ms` alone (0: none, no bytes)."""
    if not deadline_unix_ms:
        return b""
    n = deadline_unix_ms & _U64  # an int64 is written as its 64-bit two's complement
    out = bytearray(_DEADLINE_TAG)
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class EncodedRunRequest(Serialized):
    """One attempt's RunRequest bytes: the request's, then its deadline field.

    The contract's codec calls `SerializeToString` (joined there, once, as the
    bytes go out)."""

    __slots__ = ("_body", "_deadline", "deadline_unix_ms", "message", "run_id")

    def __init__(
        self,
        body: bytes,
        deadline: bytes,
        run_id: str,
        *,
        message: pb.RunRequest | None = None,
        deadline_unix_ms: int = 0,
    ) -> None:
        self._body = body
        self._deadline = deadline
        self.run_id = run_id
        # The request's message, where it kept it (`PreparedRunRequest.message`), and
        # this attempt's deadline (the field `deadline` holds).
        self.message = message
        self.deadline_unix_ms = deadline_unix_ms

    def __len__(self) -> int:
        return len(self._body) + len(self._deadline)

    def __bytes__(self) -> bytes:
        return self._body + self._deadline

    def SerializeToString(self) -> bytes:
        return self._body + self._deadline


class PreparedRunRequest:
    """A request's RunRequest, serialized once without its deadline, for every attempt,
    and its prefix fingerprint (for routing; None: not taken).

    `message`: the RunRequest the bytes were serialized from, without its prefix
    blocks, where the request keeps it (`prepare_run_request(keep_message=True)`):
    a client that relays runs without gRPC takes it instead of parsing the bytes
    again (`edge.nodes.direct`). Every attempt shares it: nobody changes it.
    """

    __slots__ = ("body", "message", "prefix", "run_id")

    def __init__(
        self,
        body: bytes,
        run_id: str,
        prefix: Fingerprint | None = None,
        message: pb.RunRequest | None = None,
    ) -> None:
        self.body = body
        self.run_id = run_id
        self.prefix = prefix
        self.message = message

    def __len__(self) -> int:
        return len(self.body)

    def attempt(self, deadline_unix_ms: int) -> EncodedRunRequest:
        """The bytes of an attempt whose node deadline is `deadline_unix_ms` (0: none).
        A few bytes of work: the request's bytes are shared, not copied."""
        return EncodedRunRequest(
            self.body, deadline_field(deadline_unix_ms), self.run_id, message=self.message,
            deadline_unix_ms=deadline_unix_ms,
        )  # fmt: skip

    def continued(self, text: str, reasoning: str, output_tokens: int) -> PreparedRunRequest:
        """This request continuing an answer: `text` and `reasoning` so far, and the output
        tokens they took. Copies the request's bytes and serializes the answer so far:
        work that grows with both, for a worker thread.

        Raises:
            PayloadTooLargeError: the bytes, with room for any deadline, are over the
                nodes' gRPC message limit (the answer so far is too long to send).
        """
        continuation = pb.Continuation(
            text=text, reasoning=reasoning, output_tokens=min(output_tokens, _U32)
        )
        field = bytes(pb.RunRequest(continuation=continuation))
        size = len(self.body) + len(field)
        if size + DEADLINE_ROOM > MAX_MESSAGE_BYTES:
            raise PayloadTooLargeError(
                f"the answer so far makes the request {size} bytes as a RunRequest, over"
                f" the {MAX_MESSAGE_BYTES}-byte gRPC message limit of the nodes"
            )
        return PreparedRunRequest(self.body + field, self.run_id, self.prefix)


def cache_salt(scope: str) -> str:
    """The `cache_salt` of a KV-cache scope ("" shared: none): a hash, so a node and its
    model server see no key's name."""
    if not scope:
        return ""
    return hashlib.sha256(f"iop-edge cache scope {scope}".encode()).hexdigest()[:32]


def prepare_run_request(
    request: ChatRequest,
    *,
    run_id: str,
    model: str,
    keep_message: bool = False,
    cache_scope: str = "",
) -> PreparedRunRequest:
    """The RunRequest `run_request_from_chat` builds, with the request's prefix
    fingerprint, serialized without its deadline. Work that grows with the request:
    run it off the event loop. `keep_message`: the RunRequest itself goes with its
    bytes (`PreparedRunRequest.message`). `cache_scope` (the API key's, "" shared):
    its prefix blocks are salted with it, and its `cache_salt` is made from it.

    Raises:
        PayloadTooLargeError: (413) the bytes, with room for any deadline, are over
            the nodes' gRPC message limit: refused before a node slot is taken.
    """
    message = run_request_from_chat(request, run_id=run_id, model=model)
    # The chain starts from the salt, which the node sees: a node that renders the
    # prompt again (iop-node's KV mapping) checks its hashes against these.
    message.cache_salt = cache_salt(cache_scope)
    prefix = fingerprint(
        request, model, block_chars=PREFIX_BLOCK_CHARS, max_blocks=MAX_PREFIX_BLOCKS,
        scope=message.cache_salt,
    )  # fmt: skip
    message.prefix_blocks = prefix.blocks.tolist()
    message.prompt_chars = prefix.chars
    body = bytes(message)
    if len(body) + DEADLINE_ROOM > MAX_MESSAGE_BYTES:
        raise PayloadTooLargeError(
            f"the request is {len(body)} bytes as a RunRequest, over the"
            f" {MAX_MESSAGE_BYTES}-byte gRPC message limit of the nodes"
        )
    if not keep_message:
        return PreparedRunRequest(body, run_id, prefix)
    message.prefix_blocks = []  # the routing's, in the bytes: not the relay's
    return PreparedRunRequest(body, run_id, prefix, message)
