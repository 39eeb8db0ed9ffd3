"""The simulated node's KV cache model: which of a prompt's blocks it holds, what the
runs in flight hold, and the prompt's size in tokens. Off unless the node is given a
capacity (`--kv-tokens`).

A prompt is the edge's fingerprint of it (`RunRequest.prefix_blocks`: chained
hashes of its whole blocks of PREFIX_BLOCK_CHARS characters, so a hash stands
for its block and every block before it) and its length (`prompt_chars`); it
is `prompt_chars // CHARS_PER_TOKEN` tokens, a block BLOCK_TOKENS of them.
`prompt` reads both; an older edge sends neither: the prompt is then its
messages' text length // CHARS_PER_TOKEN tokens, and nothing of it is cached.

`KVCache` is a pool of `capacity` blocks kept as vLLM's KV cache manager keeps
its own (`vllm/v1/core/kv_cache_manager.py`, `block_pool.py`):
- A run in flight holds its blocks (`Lease`, from `start` to `end`): its
  prompt's cached blocks, pinned (vLLM's ref_cnt > 0: shared by the runs
  that use them, in no free queue, never evicted), and blocks of its own
  (`private`): ceil((prompt tokens + generated tokens) / BLOCK_TOKENS) less
  its cached blocks, that is its prompt past its whole blocks (a partial
  last block) and the tokens it generates (`decoded`, per delta sent).
- The other blocks are in the free queue, evicted from its head as blocks
  are needed (a new prompt block, a run's block of its own) once the pool is
  full. A run that ends (`end`, whatever the end) frees its blocks to the
  queue's tail in reverse order, its own blocks first, then its prompt's
  last to first, so that a chain's end is evicted before its beginning and
  a block held always has the blocks before it (a match is never cut short
  by a hole). Its own blocks hold no prefix of any prompt (vLLM caches them
  under hashes no edge block has): in the queue they are anonymous, taking
  room until they reach the head, as in vLLM, and nothing is reported of
  them.
- `match`: the longest leading run of a prompt's blocks held (pinned or
  free); those are its cached tokens (at most the prompt's). `ready` says
  when the last of them is computed. `start` pins them, taking them out of
  the free queue (vLLM's `touch`), stores the prompt's other blocks, and
  takes its own blocks; `store` is a run that starts and ends at once.
- More runs than fit: when the blocks in use (`in_use`) reach the capacity,
  a run still starts and plays: its blocks that find no room are its own
  (not cached), and the free queue is empty while the blocks in use stay
  past the capacity. vLLM would keep such a run waiting (its scheduler
  admits a request only when its blocks can be allocated) or preempt one
  that runs. Here the node's cap on runs (`--max-runs`) is the only
  admission: a second queue, by blocks, beside it would model the wait but
  not the preemption, and the fleet benchmarks size the cap so that the runs
  in flight fit. A run past what fits costs the others their cached
  prefixes (as it would once admitted), and no more time than its prefill.
  So the pool holds at most `capacity` cached blocks (pinned and free), and
  free blocks only while the blocks in use leave room for them:
  len(free queue) <= max(0, capacity - in_use).
A run stores its blocks when its prefill starts, each new one with the time
its prefill ends (`ready`), as vLLM commits a step's blocks to its prefix
cache when it schedules the step (`KVCacheManager.allocate_slots`), and
publishes them then: a run that comes during that prefill finds them, and
waits for them to be computed instead of computing them again.
Bounded: `start` and `end` cost O(the run's blocks, and the blocks they
evict), `decoded` O(1 and the blocks it evicts); the free queue holds at most
`capacity` entries, the pool at most `capacity` cached blocks (a snapshot fits
one report). Every store and eviction goes to `log`, the
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


def delta_tokens(text: str) -> int:
    """The tokens of a delta of `text`: max(1, len // CHARS_PER_TOKEN) (decode pace, and
    the blocks a run's answer takes)."""
    return max(1, len(text) // CHARS_PER_TOKEN)


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


class Lease:
    """What one run holds in the cache while it lives (`KVCache.start` to `KVCache.end`):
    its cached prompt blocks (pinned), its tokens, and the blocks of its own it takes
    (`private`: its prompt past those blocks and its answer so far)."""

    __slots__ = ("blocks", "ended", "generated", "private", "tokens")

    def __init__(self, blocks: tuple[int, ...], tokens: int) -> None:
        self.blocks = blocks
        self.tokens = tokens
        self.generated = 0
        self.private = 0
        self.ended = False


class KVCache:
    """A vLLM-like pool of `capacity` blocks: those of the runs in flight, and a free
    queue of the others, evicted least recently freed first (the module says how)."""

    __slots__ = ("_anonymous", "_free", "_held", "_private", "_refs", "capacity", "log")

    def __init__(self, capacity: int) -> None:
        if not 0 <= capacity <= MAX_KV_BLOCKS_PER_REPORT:
            raise ValueError(f"capacity must be 0 to {MAX_KV_BLOCKS_PER_REPORT} blocks")
        self.capacity = capacity
        # Every block held (matchable), pinned or free, with the time it is computed.
        self._held: dict[int, float] = {}
        # The runs in flight that pin each of their cached blocks (a block here is in use).
        self._refs: dict[int, int] = {}
        # The runs' own blocks in use, which no prompt shares (a count: they have no hash).
        self._private = 0
        # The free queue, next evicted first: blocks held but in no run's use, and the
        # freed blocks of runs' own (negative keys: no hash, nothing to report).
        self._free: OrderedDict[int, None] = OrderedDict()
        self._anonymous = 0  # the last key given to such a block (-1, -2, ...)
        self.log = BlockLog(capacity, self.blocks)

    @property
    def held(self) -> int:
        """The blocks held now (pinned or free)."""
        return len(self._held)

    @property
    def in_use(self) -> int:
        """The blocks of the runs in flight: their cached prompt blocks (each once, however
        many runs share it) and their own. Past `capacity` when more runs play than fit."""
        return len(self._refs) + self._private

    @property
    def free(self) -> int:
        """The blocks in the free queue: held but in no run's use, or anonymous."""
        return len(self._free)

    @property
    def pinned(self) -> int:
        """The blocks held that some run in flight uses (never evicted)."""
        return len(self._refs)

    def __contains__(self, block: int) -> bool:
        return block in self._held

    def blocks(self) -> list[int]:
        """The blocks held, least recently used first: the free ones in eviction order,
        then the pinned ones (in use, so the most recent)."""
        free = [block for block in self._free if block >= 0]
        return [*free, *self._refs]

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

    def start(self, blocks: Sequence[int], tokens: int, ready: float = 0.0) -> Lease:
        """A run of a prompt of `tokens` tokens whose blocks are `blocks` starts its
        prefill: its blocks held are pinned, the others stored (computed at `ready`) and
        pinned while there is room for them, and its own blocks taken; the least
        recently freed blocks are evicted to make room. Returns what it holds, for
        `decoded` and `end`."""
        held, refs, free, log = self._held, self._refs, self._free, self.log
        chain = blocks[:MAX_PREFIX_BLOCKS]
        hit = self.match(chain)
        for block in chain[:hit]:
            count = refs.get(block, 0)
            if not count:
                del free[block]
            refs[block] = count + 1
        cached = hit
        room = self.capacity - self.in_use - len(free)  # blocks never used yet
        for block in chain[hit:]:
            if room > 0:
                room -= 1
            elif free:
                self._make_room(1)  # the pool is full: one block goes, the queue's head
            else:
                break  # no room: the prompt's other blocks are the run's own
            held[block] = ready
            refs[block] = 1
            log.stored(block)
            cached += 1
        lease = Lease(tuple(chain[:cached]), tokens)
        self._take(lease)
        return lease

    def decoded(self, lease: Lease, tokens: int) -> bool:
        """The run of `lease` generated `tokens` more tokens; returns whether it took a
        block for them (the blocks in use changed)."""
        if lease.ended:
            return False
        lease.generated += tokens
        return self._take(lease)

    def end(self, lease: Lease) -> bool:
        """The run of `lease` ended: its blocks go to the free queue's tail, its own first
        (anonymous), then its prompt's, last to first, each once no other run pins it.
        Returns False if it had ended already (a second end changes nothing)."""
        if lease.ended:
            return False
        lease.ended = True
        refs, free = self._refs, self._free
        self._private -= lease.private
        freed = []
        for block in reversed(lease.blocks):
            count = refs[block] - 1
            if count:
                refs[block] = count
            else:
                del refs[block]
                freed.append(block)
        # Of its own blocks, those past the room left would be evicted at once (every
        # block after them in the queue stays before they do): only the others go in.
        for _ in range(min(lease.private, max(0, self.capacity - self.in_use))):
            self._anonymous -= 1
            free[self._anonymous] = None
        for block in freed:
            free[block] = None
        self._make_room(0)
        return True

    def store(self, blocks: Sequence[int], ready: float = 0.0) -> bool:
        """A run of exactly `blocks` (its whole blocks, nothing of its own) that starts and
        ends at once: its blocks held are touched (they keep their time), the others
        stored, computed at `ready`. Returns whether blocks were stored or evicted (the
        node's watchers have news)."""
        before = self.log.end
        chain = blocks[:MAX_PREFIX_BLOCKS]
        self.end(self.start(chain, len(chain) * BLOCK_TOKENS, ready))
        return self.log.end != before

    def _take(self, lease: Lease) -> bool:
        """The run of `lease` takes the blocks of its own its tokens need now; returns
        whether that changed."""
        total = -(-(lease.tokens + lease.generated) // BLOCK_TOKENS)
        private = max(0, total - len(lease.blocks))
        if private == lease.private:
            return False
        self._private += private - lease.private
        lease.private = private
        self._make_room(0)
        return True

    def _make_room(self, wanted: int) -> None:
        """Evict from the free queue's head until `wanted` more blocks fit beside those in
        use and in the queue, or the queue is empty."""
        held, free, log = self._held, self._free, self.log
        while free and self.in_use + len(free) + wanted > self.capacity:
            block, _ = free.popitem(last=False)
            if block >= 0:  # else anonymous: nothing to report
                del held[block]
                log.evicted(block)
