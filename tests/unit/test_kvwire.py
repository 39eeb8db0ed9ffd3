"""vLLM's and SGLang's KV event batches as iop-node reads them (`edge.nodes.upstream.kvwire`),
encoded by the servers' own struct definitions (tests/integration/kv_fixtures)."""

from __future__ import annotations

from types import ModuleType

import msgspec
import pytest

from edge.nodes.upstream.kvwire import (
    END_SEQ,
    Cleared,
    Removed,
    Sequence,
    Stored,
    WireError,
    decode_batch,
    replay_request,
    split_frames,
    split_replay,
)
from tests.integration.kv_fixtures import sglang, vllm_arrays, vllm_maps, vllm_mixed, vllm_v0_9

FORMATS = (vllm_v0_9, vllm_arrays, vllm_maps, vllm_mixed, sglang)
TOKENS = list(range(100, 132))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_servers_batch_reads_as_the_same_events(fmt: ModuleType) -> None:
    """A store of two blocks (a 64-bit hash beside a small one), a removal and a clear,
    encoded as each version of each server encodes them, read as the same events."""
    big = 2**64 - 3
    events = [fmt.stored([big, 7], None, TOKENS, 16, ""), fmt.stored([9], big, TOKENS[:16], 16,
              ""), fmt.removed([7, big]), fmt.cleared()]  # fmt: skip
    batch = decode_batch(msgspec.msgpack.encode(fmt.batch(2.5, events, 0)))
    assert batch.ts == 2.5
    assert batch.events == (
        Stored((big, 7), None, tuple(TOKENS), 16),
        Stored((9,), big, tuple(TOKENS[:16]), 16),
        Removed((7, big)),
        Cleared(),
    )


def test_vllms_cache_salt_in_extra_keys_is_a_hint() -> None:
    """vLLM's `extra_keys` of a first block (its cache salt among them) and `lora_name`
    are the store's hints; SGLang's salted store's metadata too."""
    salted = vllm_maps.stored([1, 2], None, TOKENS, 16, "tenant-a")
    (event,) = decode_batch(msgspec.msgpack.encode(vllm_maps.batch(1.0, [salted], 0))).events
    assert isinstance(event, Stored)
    assert event.hints == frozenset({"tenant-a"})
    sglang_salted = [1.0, [["BlockStored", [5], None, TOKENS[:16], 16, None, "GPU",
                             {"cache_salt": "tenant-b"}]], 0]  # fmt: skip
    (event,) = decode_batch(msgspec.msgpack.encode(sglang_salted)).events
    assert isinstance(event, Stored)
    assert event.hints == frozenset({"tenant-b"})


def test_other_tiers_groups_and_kinds_are_left_out() -> None:
    """A store or removal on the CPU tier, or in another KV cache group, and an event of an
    unknown kind are not read; bytes hashes are kept as bytes."""
    events = [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": TOKENS[:16], "block_size": 16, "lora_id": None, "medium": "CPU"},
        {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": None,
         "token_ids": TOKENS[:16], "block_size": 16, "lora_id": None, "medium": "GPU",
         "group_idx": 1},
        {"type": "BlockRemoved", "block_hashes": [3], "medium": "CPU_PINNED"},
        {"type": "BlockTransferred", "block_hashes": [4]},
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
    ]  # fmt: skip
    batch = decode_batch(msgspec.msgpack.encode({"ts": 1, "events": events}))
    assert batch.events == (Removed((b"\x01" * 32,)),)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["x", []]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2], 16, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [-1] * 16, 16, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", ["h"], None, [1] * 16, 16, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [], 0, None]]]),
        msgspec.msgpack.encode([1.0, [[3]]]),
        msgspec.msgpack.encode([1.0, ["BlockRemoved"]]),
    ],
)
def test_what_is_not_a_batch_is_a_wire_error(raw: bytes) -> None:
    """Not msgpack, not (ts, events), a store whose tokens do not fill its blocks, a token
    id out of range, a hash that is a string, an event that is not tagged: WireError."""
    with pytest.raises(WireError):
        decode_batch(raw)


def test_the_framing_of_live_and_replayed_messages() -> None:
    """A live message is (topic, number, batch); a replay is asked with the number after an
    empty frame, answered (b"", number, batch) each, then (b"", -1, b"")."""
    assert split_frames([b"kv", (5).to_bytes(8, "big"), b"x"]) == (5, b"x")
    assert replay_request(7) == [b"", (7).to_bytes(8, "big")]
    assert split_replay([b"", (7).to_bytes(8, "big"), b"y"]) == (7, b"y")
    assert split_replay([b"", END_SEQ, b""]) is None
    for frames in ([b"kv", b"1", b"x"], [b"kv", b"x"]):
        with pytest.raises(WireError):
            split_frames(frames)
    with pytest.raises(WireError):
        split_replay([b"id", (7).to_bytes(8, "big"), b"y"])


def test_the_sequence_tells_the_next_a_gap_a_replayed_one_and_a_new_life() -> None:
    """From the first number on: the next is next, one past it a gap, one below the next but
    above the last live one was replayed already, one not above the last live one is a
    new life of the publisher (it counts from 0 again)."""
    seq = Sequence()
    assert seq.check(40) == "next"
    seq.advance(40)
    assert seq.check(41) == "next"
    seq.advance(41)
    assert seq.check(45) == "gap"
    for replayed in (42, 43, 44, 45, 46):
        seq.advance(replayed)
    assert seq.check(46) == "seen"  # live after the replay brought it
    assert seq.check(47) == "next"
    seq.advance(47)
    assert seq.check(0) == "restart"
