"""Session affinity: which node a session key prefers, with bounded load.

Rendezvous (highest random weight) hashing: each node gets a score from a
hash of (key, node name), and the key's order is the nodes by descending
score. A node joining takes exactly the keys it now scores highest for; a
node leaving gives up only its own keys, each to that key's next node: no
other key moves. The hash is BLAKE2b, not Python's `hash` (salted per
process), so every edge process, and every hypercorn worker, sends a
session to the same node.

Bounded load: a key goes to the first node in its order whose runs in
flight are within LOAD_FACTOR times the mean of the candidates (+1, so
small counts work: with 0 or 1 run per node the preferred node is not
skipped for one run); a node past it passes the key to the next; when none
qualifies, the least loaded. Pure: no I/O, no clock; the pool passes the
candidates that may take a run now.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

LOAD_FACTOR = 1.25


@dataclass(frozen=True, slots=True)
class SessionKey:
    """What ties a request to its session's node: `key`, and whether the client named a
    session (`named`: X-Session-Id, `prompt_cache_key`) or the key is only the request's
    end user (`user`, the Messages API's `metadata.user_id`).

    The affinity policy keys on either. The cache-aware policy pins only a named
    session: its requests find their conversation's node by their prefix, and a `user`
    is a person, not a conversation (one with many conversations would be pinned to one
    node, and users hashed over the nodes place conversations unevenly: measured,
    BENCHMARKS.md)."""

    key: str
    named: bool = True


def session_key(named: str | None, user: str | None) -> SessionKey | None:
    """The request's session key: the session it names, else its `user`, else none."""
    if named:
        return SessionKey(named)
    return SessionKey(user, named=False) if user else None


def _key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _score(key_digest: bytes, node: str) -> int:
    digest = hashlib.blake2b(node.encode("utf-8", "surrogatepass"), digest_size=8, key=key_digest)
    return int.from_bytes(digest.digest(), "big")


def order(key: str, nodes: Sequence[str]) -> list[int]:
    """The indices of `nodes` in `key`'s order of preference (ties: the earlier index)."""
    digest = _key_digest(key)
    scores = [_score(digest, name) for name in nodes]
    return sorted(range(len(nodes)), key=lambda i: (-scores[i], i))


def choose(key: str, nodes: Sequence[tuple[str, int]], *, factor: float = LOAD_FACTOR) -> int:
    """The index in `nodes` ((name, runs in flight), not empty) the run of `key` goes to."""
    if not nodes:
        raise ValueError("no node to choose from")
    loads = [load for _, load in nodes]
    bound = factor * sum(loads) / len(loads) + 1
    for i in order(key, [name for name, _ in nodes]):
        if loads[i] <= bound:
            return i
    return min(range(len(nodes)), key=lambda i: (loads[i], i))  # pragma: no cover - min <= mean
