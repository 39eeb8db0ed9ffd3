"""vLLM's array-like events with `medium` and the batch's `data_parallel_rank`: the
types of `examples/online_serving/kv_events_subscriber.py` at
0ef0f42653bc5a0c7c44d26ce3a161e692b07a2c ("copied from vllm.distributed.kv_events"),
with the rank its publisher sets since data parallelism (v0.10, v0.11)."""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def stored(hashes: list[int], parent: int | None, tokens: list[int], size: int, salt: str) -> Any:
    return BlockStored(hashes, parent, tokens, size, None, "GPU")


def removed(hashes: list[int]) -> Any:
    return BlockRemoved(hashes, "GPU")


def cleared() -> Any:
    return AllBlocksCleared()


def batch(ts: float, events: list[Any], rank: int) -> Any:
    return KVEventBatch(ts, events, rank)
