"""vLLM's `vllm/distributed/kv_events.py` at 0181ea3173e53eea8cf04a86891488e3dc89bb34:
no `array_like` (vllm-project/vllm#42892): the batch and its events are maps, an
event's tag under `type`; `extra_keys` per block (the first block's with its cache
salt), `group_idx`, the cache spec's kind."""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def stored(hashes: list[int], parent: int | None, tokens: list[int], size: int, salt: str) -> Any:
    extra = [(salt,) if salt and i == 0 and parent is None else None for i in range(len(hashes))]
    return BlockStored(hashes, parent, tokens, size, None, "GPU", None, extra, 0, "full_attention")


def removed(hashes: list[int]) -> Any:
    return BlockRemoved(hashes, "GPU", 0)


def cleared() -> Any:
    return AllBlocksCleared()


def batch(ts: float, events: list[Any], rank: int) -> Any:
    return KVEventBatch(ts, events, rank)
