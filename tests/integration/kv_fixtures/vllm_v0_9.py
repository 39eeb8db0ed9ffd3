"""vLLM's `vllm/distributed/kv_events.py` at b4e69e0af33f4698e157a262cc787fe61983cd3d
(v0.9): array-like batches and events, no medium."""

# ruff: noqa: UP007, UP045  (the source's own spelling of the types)
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def stored(hashes: list[int], parent: int | None, tokens: list[int], size: int, salt: str) -> Any:
    return BlockStored(hashes, parent, tokens, size, None)


def removed(hashes: list[int]) -> Any:
    return BlockRemoved(hashes)


def cleared() -> Any:
    return AllBlocksCleared()


def batch(ts: float, events: list[Any], rank: int) -> Any:
    return KVEventBatch(ts, events)
