"""The simulated node's KV cache model: which of a prompt's blocks it holds, and the
prompt's size in tokens. Off unless the node is given a capacity (`--kv-tokens`).

A prompt is the edge's fingerprint of it (`RunRequest.prefix_blocks`: chained
hashes of its whole blocks of PREFIX_BLOCK_CHARS characters, so a hash stands
for its block and every block before it) and its length (`prompt_chars`); it
is `prompt_chars // CHARS_PER_TOKEN` tokens, a block BLOCK_TOKENS of them.
`prompt` reads both; an older edge sends neither: the prompt is then its
messages' text length // CHARS_PER_TOKEN tokens, and nothing of it is cached.

`KVCache` holds at most `capacity` blocks, an LRU keyed by those hashes:
- `match`: the longest leading run of a prompt's blocks held; those are its
  cached tokens (at most the prompt's). `ready` says when the last of them
  is computed.
- `store`: hold a run's blocks (touching those held already), then evict the
  least recently used past the capacity. The blocks are touched last to
  first, so a block is always more recent than the blocks after it in its
  chain: eviction takes the ends of chains first (as vLLM's free queue does)
  and never leaves a block held without the blocks before it, so a match is
  never cut short by a hole. A run stores at most its first `capacity` (and
  MAX_PREFIX_BLOCKS) blocks: more could not stay together.
A run stores its blocks when its prefill starts, each new one with the time
its prefill ends (`ready`), as vLLM commits a step's blocks to its prefix
cache when it schedules the step (`KVCacheManager.allocate_slots`), and
publishes them then: a run that comes during that prefill finds them, and
waits for them to be computed instead of computing them again.
Each costs O(the run's blocks); the cache holds its capacity (plus one run's
blocks while it evicts). Every store and eviction goes to `log`, the
`edge.nodes.blocklog.BlockLog` the node's Watch reports from.

Pure: no asyncio, no gRPC stream.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import (
    BLOCK_TOKENS,
    CHARS_PER_TOKEN,
    MAX_KV_BLOCKS_PER_REPORT,
    MAX_PREFIX_BLOCKS,
)
from edge.nodes.blocklog import BlockLog
from edge.nodes.sim.script import message_text

# The largest cache, in tokens: its blocks must fit one Watch report (a snapshot).
MAX_KV_TOKENS = MAX_KV_BLOCKS_PER_REPORT * BLOCK_TOKENS
# Usage counts are uint32: a prompt counts at most this many tokens.
MAX_PROMPT_TOKENS = 2**32 - 1


@dataclass(frozen=True, slots=True)
class KVSettings:
    """The cache model's settings (`iop-sim-node --kv-tokens ...`, docs/simulated-node.md).

    `kv_tokens` 0: the model is off (no cache, no prefill time); else the
    cache holds `kv_tokens // BLOCK_TOKENS` blocks and a run waits
    `prefill_us_per_token` per uncached prompt token before its first event.
    `decode_tokens_per_s` > 0 paces every run's deltas (the model on or not).
    """

    kv_tokens: int = 0
    prefill_us_per_token: float = 100.0
    decode_tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.kv_tokens <= MAX_KV_TOKENS:
            raise ValueError(f"kv_tokens must be 0 to {MAX_KV_TOKENS}, not {self.kv_tokens}")
        for name in ("prefill_us_per_token", "decode_tokens_per_s"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number from 0, not {value}")


@dataclass(frozen=True, slots=True)
class Prompt:
    """A run's prompt as the cache model sees it: its tokens, and its blocks to match
    and store (empty: an older edge, or a prompt shorter than a block)."""

    tokens: int
    blocks: Sequence[int]


def prompt(request: pb.RunRequest) -> Prompt:
    """The prompt of `request`: its `prompt_chars` and first MAX_PREFIX_BLOCKS blocks, or,
    from an edge that sends no fingerprint, its messages' text, uncached. A run that
    continues an answer also reads what its continuation holds (text and reasoning),
    after the prompt's blocks: a model server prefills the partial answer too."""
    held = request.continuation
    extra = 0 if held is None else len(held.text) + len(held.reasoning)
    if request.prompt_chars:
        chars = request.prompt_chars + extra
        tokens = min(chars // CHARS_PER_TOKEN, MAX_PROMPT_TOKENS)
        return Prompt(tokens, request.prefix_blocks[:MAX_PREFIX_BLOCKS])
    chars = sum(len(message_text(m)) for m in request.messages) + extra
    return Prompt(min(chars // CHARS_PER_TOKEN, MAX_PROMPT_TOKENS), ())


class KVCache:
    """An LRU of at most `capacity` blocks (the module says how it matches and stores)."""

    __slots__ = ("_held", "capacity", "log")

    def __init__(self, capacity: int) -> None:
        if not 0 <= capacity <= MAX_KV_BLOCKS_PER_REPORT:
            raise ValueError(f"capacity must be 0 to {MAX_KV_BLOCKS_PER_REPORT} blocks")
        self.capacity = capacity
        # The blocks held, least recently used first, each with the time it is computed.
        self._held: OrderedDict[int, float] = OrderedDict()
        self.log = BlockLog(capacity, self._held.keys)

    @property
    def held(self) -> int:
        """The blocks held now."""
        return len(self._held)

    def __contains__(self, block: int) -> bool:
        return block in self._held

    def blocks(self) -> list[int]:
        """The blocks held, least recently used first."""
        return list(self._held)

    def match(self, blocks: Sequence[int]) -> int:
        """How many of `blocks`, from the first, are held (the prompt's cached blocks)."""
        held = self._held
        count = 0
        for block in blocks[:MAX_PREFIX_BLOCKS]:
            if block not in held:
                break
            count += 1
        return count

    def ready(self, blocks: Sequence[int], count: int) -> float:
        """When the first `count` of `blocks` (held: `match`'s count) are all computed."""
        held = self._held
        return max((held[block] for block in blocks[:count]), default=0.0)

    def store(self, blocks: Sequence[int], ready: float = 0.0) -> bool:
        """Hold a run's `blocks` (its first `capacity` of them), touching those held (they
        keep their time), the new ones computed at `ready`; then evict the least recently
        used past the capacity. Returns whether the set of blocks held changed (stores or
        evictions: the node's watchers have news)."""
        held, log = self._held, self.log
        changed = False
        for block in reversed(blocks[: min(self.capacity, MAX_PREFIX_BLOCKS)]):
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = ready
                log.stored(block)
                changed = True
        while len(held) > self.capacity:
            block, _ = held.popitem(last=False)
            log.evicted(block)
        return changed
