"""The KV cache events vLLM and SGLang publish, as they are on the wire.

Both servers (`--kv-events-config`, publisher `zmq`) send each batch of events
on a ZMQ PUB socket as a multipart message of three frames: the topic, the
batch's sequence number (8 bytes, big-endian, from 0 in each life of the
publisher) and the batch, msgpack (msgspec's encoding of `KVEventBatch`). A
ROUTER socket (the `replay_endpoint`) sends again the batches it still holds
(`buffer_steps`) from a number asked as 8 big-endian bytes: one message
(number, batch) each, then the number -1 with an empty batch.

A batch is `(ts, events, rank)`: an array (vLLM until its events became maps,
SGLang) or a map (`ts`, `events`, `data_parallel_rank`). Each event is tagged,
as an array whose first item is its tag (msgspec's `array_like` structs,
trailing defaults omitted) or as a map whose `type` is its tag:

- `BlockStored`: `block_hashes`, `parent_block_hash`, `token_ids` (the new
  blocks' tokens, `block_size` each), `block_size`, `lora_id`, then vLLM's
  `medium`, `lora_name`, `extra_keys` (per block: its LoRA name, multimodal
  hashes, `cache_salt`), `group_idx`, ...; SGLang's `medium`, and a `metadata`
  map with its `cache_salt`.
- `BlockRemoved`: `block_hashes`, then `medium`, `group_idx`.
- `AllBlocksCleared`.

A block hash is an integer (any sign, up to 64 bits) or bytes: both are kept as
they come, as keys. `decode_batch` reads one batch into frozen events, keeping
what the KV mapping needs (`edge.nodes.upstream.kvmap`): a store or removal of
a medium other than the GPU's (an offload tier) or of a KV cache group other
than the first (a hybrid model's sliding-window layers) is left out, as is an
event of a kind it does not know. `hints` are the strings a store names its
first block's keys with (LoRA name, cache salt): what tells two scopes' equal
first blocks apart, where a server says it.

`Sequence` keeps a subscriber's place in the numbering: the next number, a
gap (a replay may fill it), or a number already seen on the live socket (a
new life of the publisher: it counts from 0 again).

Pure: bytes in, events out; it knows nothing of sockets. The formats are read
from vLLM's `vllm/distributed/kv_events.py` and SGLang's
`python/sglang/srt/disaggregation/kv_events.py`
(tests/integration/kv_fixtures/README.md names the versions).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

__all__ = [
    "END_SEQ",
    "Batch",
    "BlockHash",
    "Cleared",
    "Event",
    "Removed",
    "Sequence",
    "Stored",
    "WireError",
    "decode_batch",
    "replay_request",
    "split_frames",
    "split_replay",
]

BlockHash = int | bytes
# The replay's end marker: the number -1 (8 bytes, big-endian, signed).
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
# A token id is unsigned 32-bit (every vocabulary is far smaller).
_MAX_TOKEN = 2**32 - 1
# The positions of the fields after the tag in an array-encoded event.
_STORED_FIELDS: Final = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx",
)  # fmt: skip
_REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx")
_GPU: Final = frozenset({None, "GPU", "gpu"})


class WireError(ValueError):
    """A message that is not what the servers send: its words say what was wrong."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks newly in the server's prefix cache, a chain from `parent` (None: from
    the start of a prompt): `tokens` holds `block_size` token ids per hash."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    tokens: tuple[int, ...]
    block_size: int
    hints: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks the server evicted from its prefix cache."""

    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    """The server emptied its prefix cache."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    """One published batch: its events in order, and the rank that sent it."""

    ts: float
    events: tuple[Event, ...]
    rank: int | None = None


def split_frames(frames: list[bytes]) -> tuple[int, bytes]:
    """A live message's (sequence number, batch); WireError when it has not the three
    frames (topic, number, batch)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise WireError(f"a message of {len(frames)} frames, not (topic, 8-byte number, batch)")
    return int.from_bytes(frames[1], "big"), frames[2]


def replay_request(start: int) -> list[bytes]:
    """What a DEALER socket sends the replay ROUTER to get the batches from `start` on
    (the empty delimiter, then the number)."""
    return [b"", start.to_bytes(8, "big")]


def split_replay(frames: list[bytes]) -> tuple[int, bytes] | None:
    """A replayed message on a DEALER socket as (number, batch); None for the end marker;
    WireError for anything else."""
    if len(frames) != 3 or frames[0] or len(frames[1]) != 8:
        raise WireError(f"a replay message of {len(frames)} frames, not (b'', number, batch)")
    if frames[1] == END_SEQ:
        return None
    return int.from_bytes(frames[1], "big"), frames[2]


def decode_batch(payload: bytes) -> Batch:
    """One batch, array- or map-encoded; WireError when it is not a batch."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise WireError("a batch is (ts, events[, rank])")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise WireError("a batch's ts is a number and its events a list")
    return Batch(float(ts), tuple(_events(events)), rank if isinstance(rank, int) else None)


def _events(raw: list[Any]) -> Iterator[Event]:
    for item in raw:
        tag, fields = _fields(item)
        if tag == "BlockStored":
            stored = _stored(fields)
            if stored is not None:
                yield stored
        elif tag == "BlockRemoved":
            if _kept(fields):
                yield Removed(_hashes(fields.get("block_hashes")))
        elif tag == "AllBlocksCleared":
            yield Cleared()


def _fields(item: Any) -> tuple[str, dict[str, Any]]:
    """An event's tag and its fields by name, from either encoding."""
    if isinstance(item, dict):
        tag = item.get("type")
        fields = item
    elif isinstance(item, list) and item:
        tag = item[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, item[1:], strict=False))
        # SGLang's salted store: its metadata map follows `medium`.
        if tag == "BlockStored" and len(item) > 7 and isinstance(item[7], dict):
            fields["metadata"] = item[7]
            fields.pop("lora_name", None)
    else:
        raise WireError("an event is a tagged array or map")
    if not isinstance(tag, str):
        raise WireError("an event's tag is a string")
    return tag, fields


def _kept(fields: dict[str, Any]) -> bool:
    """Whether an event is of the GPU's prefix cache, in its first (or only) group."""
    return fields.get("medium") in _GPU and fields.get("group_idx") in (None, 0)


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise WireError("block_hashes is a list of integers or bytes")
    return tuple(value)


def _stored(fields: dict[str, Any]) -> Stored | None:
    if not _kept(fields):
        return None
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    tokens = fields.get("token_ids")
    size = fields.get("block_size")
    if parent is not None and not isinstance(parent, int | bytes):
        raise WireError("parent_block_hash is an integer, bytes or null")
    if not isinstance(size, int) or size < 1:
        raise WireError("block_size is a positive integer")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and 0 <= t <= _MAX_TOKEN for t in tokens
    ):
        raise WireError("token_ids is a list of token ids")
    if len(tokens) != len(hashes) * size:
        raise WireError(f"{len(tokens)} token ids for {len(hashes)} blocks of {size}")
    return Stored(hashes, parent, tuple(tokens), size, _hints(fields))


def _hints(fields: dict[str, Any]) -> frozenset[str]:
    """The strings a store names its first block's keys with: vLLM's `lora_name` and the
    strings of `extra_keys[0]` (its cache salt among them), SGLang's `metadata`."""
    found: set[str] = set()
    if isinstance(name := fields.get("lora_name"), str):
        found.add(name)
    extra = fields.get("extra_keys")
    if isinstance(extra, list) and extra:
        found.update(_strings(extra[0], depth=3))
    metadata = fields.get("metadata")
    if isinstance(metadata, dict) and isinstance(salt := metadata.get("cache_salt"), str):
        found.add(salt)
    return frozenset(found)


def _strings(value: Any, depth: int) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list | tuple) and depth > 0:
        for item in value[:64]:
            yield from _strings(item, depth - 1)


class Sequence:
    """A subscriber's place in one publisher's numbering (the module doc).

    `expected` is the next number (None before the first message); `check` says
    what a live message's number is, `advance` records one applied.
    """

    __slots__ = ("_live", "expected")

    def __init__(self) -> None:
        self.expected: int | None = None
        # The last number received on the live socket: a publisher's numbers only grow.
        self._live: int | None = None

    def check(self, seq: int) -> Literal["next", "gap", "seen", "restart"]:
        """`seq`, received live: the next one, past a gap, one a replay applied already,
        or one from a new life of the publisher (not above the last live one)."""
        last, self._live = self._live, seq
        if self.expected is None or seq == self.expected:
            return "next"
        if last is not None and seq <= last:
            return "restart"
        return "gap" if seq > self.expected else "seen"

    def advance(self, seq: int) -> None:
        self.expected = seq + 1

    def restart(self) -> None:
        """Forget the place: the next message starts the count."""
        self.expected = None
