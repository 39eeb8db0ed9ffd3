"""vLLM's batches as vLLM 0.26.0 sends them (the dump in volcano-sh/kthena#1535): the
batch array-like (ts, events, data_parallel_rank), its events maps (the events of
`vllm_maps`, vllm-project/vllm#42892)."""

from __future__ import annotations

from typing import Any

import msgspec

from tests.integration.kv_fixtures.vllm_maps import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    cleared,
    removed,
    stored,
)

__all__ = ["KVEventBatch", "batch", "cleared", "removed", "stored"]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def batch(ts: float, events: list[Any], rank: int) -> Any:
    return KVEventBatch(ts, events, rank)
