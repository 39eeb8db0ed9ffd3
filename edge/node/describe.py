"""A node's state as the edge keeps it: `NodeDescription`, read from a Describe answer
or a Watch report, checked.

A node is not trusted: what it reports is bounded before anything of the edge
keeps it (its model ids become metric labels and /v1/models entries, its
numbers rank it for routing). A report past a bound is refused whole, with an
error naming the bound (`NodeFailedError`: to the pool, the node failed to
answer), rather than cut short: a node that lists a thousand and one models
has a bug its operator should see. Numbers are clamped to their field's range
(a varint may carry more than its declared width), the KV cache in use to its
capacity, the heartbeat to HEARTBEAT_MIN_MS..HEARTBEAT_MAX_MS. A report's KV
block events (a node that keeps its cache by the edge's prefix blocks) are
at most MAX_KV_BLOCKS_PER_REPORT hashes, stored and evicted together.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import MAX_KV_BLOCKS_PER_REPORT
from edge.errors import NodeFailedError

# The models one node may list, and the characters of a model id or node name.
MAX_MODELS = 1024
MAX_NAME_CHARS = 256
_U32 = 2**32 - 1
_U64 = 2**64 - 1
# The heartbeat a node may say it keeps (ms): the edge's silence bound follows it.
HEARTBEAT_MIN_MS = 50
HEARTBEAT_MAX_MS = 60_000


@dataclass(frozen=True, slots=True)
class NodeDescription:
    """A node's models and load, as one Describe answer or Watch report gave them."""

    name: str
    models: tuple[str, ...]
    active_runs: int = 0
    max_runs: int = 0
    # The models this node gives token logprobs for (ModelInfo.logprobs).
    logprobs_models: frozenset[str] = frozenset()
    # The models it continues an answer of from RunRequest.continuation
    # (ModelInfo.continuation): a run of another node cut mid-answer may move here.
    continuation_models: frozenset[str] = frozenset()
    # Runs waiting for a place on the node (None: it does not say).
    waiting_runs: int | None = None
    # Its KV cache, in tokens: capacity and in use (None: it does not say).
    kv_cache_tokens: int | None = None
    kv_cache_used_tokens: int | None = None
    # On Watch: the heartbeat the node keeps (ms, clamped); 0 on Describe.
    heartbeat_ms: int = 0
    # On Watch: the report's number on its stream.
    seq: int = 0
    # The longest context of each model that says (ModelInfo.max_context_tokens).
    max_context_tokens: Mapping[str, int] = field(default_factory=dict)
    # On Watch, from a node that keeps its KV cache by prefix blocks: the blocks it
    # stored, then evicted, since the stream's previous report; with `kv_snapshot`,
    # `kv_stored` is every block it holds now. Empty, False: it does not say.
    kv_stored: array[int] = field(default_factory=lambda: array("Q"))
    kv_evicted: array[int] = field(default_factory=lambda: array("Q"))
    kv_snapshot: bool = False
    # This life of the node's process (DescribeResponse.instance_id): it changes when
    # the node restarts. Empty: the node does not say.
    instance: str = ""

    @property
    def kv_cache_usage(self) -> float | None:
        """The part of the KV cache in use (0 to 1), None when the node does not say."""
        if not self.kv_cache_tokens or self.kv_cache_used_tokens is None:
            return None
        return self.kv_cache_used_tokens / self.kv_cache_tokens


def _name(value: str, what: str, address: str) -> str:
    if len(value) > MAX_NAME_CHARS:
        raise NodeFailedError(
            f"node {address} reported {what} of {len(value)} characters, over the"
            f" limit of {MAX_NAME_CHARS}"
        )
    return value


def _count(value: int | None, top: int = _U32) -> int | None:
    return None if value is None else max(0, min(value, top))


def description_from_pb(
    response: pb.DescribeResponse, fallback_name: str, address: str
) -> NodeDescription:
    """The checked description of a Describe answer or Watch report of the node at
    `address` (`fallback_name`: the name the edge gives it, when the node gives none).
    Raises NodeFailedError when the report is past a bound."""
    if len(response.models) > MAX_MODELS:
        raise NodeFailedError(
            f"node {address} reported {len(response.models)} models, over the limit of {MAX_MODELS}"
        )
    models = tuple(_name(m.id, "a model id", address) for m in response.models)
    kv_events = len(response.kv_blocks_stored) + len(response.kv_blocks_evicted)
    if kv_events > MAX_KV_BLOCKS_PER_REPORT:
        raise NodeFailedError(
            f"node {address} reported {kv_events} KV block events in one report, over the"
            f" limit of {MAX_KV_BLOCKS_PER_REPORT}"
        )
    total = _count(response.kv_cache_tokens, _U64)
    used = _count(response.kv_cache_used_tokens, _U64)
    if used is not None and total is not None:
        used = min(used, total)
    heartbeat = response.heartbeat_ms
    if heartbeat:
        heartbeat = max(HEARTBEAT_MIN_MS, min(heartbeat, HEARTBEAT_MAX_MS))
    return NodeDescription(
        name=_name(response.node_name, "a name", address) or fallback_name,
        models=models,
        active_runs=_count(response.active_runs) or 0,
        max_runs=_count(response.max_runs) or 0,
        logprobs_models=frozenset(m.id for m in response.models if m.logprobs),
        continuation_models=frozenset(m.id for m in response.models if m.continuation),
        waiting_runs=_count(response.waiting_runs),
        kv_cache_tokens=total,
        kv_cache_used_tokens=used,
        heartbeat_ms=heartbeat,
        seq=_count(response.seq, _U64) or 0,
        max_context_tokens={
            m.id: c for m in response.models if (c := _count(m.max_context_tokens)) is not None
        },
        kv_stored=_hashes(response.kv_blocks_stored),
        kv_evicted=_hashes(response.kv_blocks_evicted),
        kv_snapshot=response.kv_blocks_snapshot,
        instance=_name(response.instance_id, "an instance id", address),
    )


def _hashes(values: list[int]) -> array[int]:
    """Block hashes as unsigned 64-bit values (a fixed64 field's range, whatever the
    decoder gives)."""
    return array("Q", (v & _U64 for v in values))
