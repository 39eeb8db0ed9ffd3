"""The counters in Redis: limits that hold across every edge (and worker) using it.

Redis is reached through `edge.node.redis` (redis-py's asyncio client,
awaited through the edge's one trio-asyncio bridge): no thread per call, one
connection pool per process, and a trio cancel (the request's deadline, the
client leaving) cancels the Redis call itself. (The sync client in
`trio.to_thread` would cost a thread hop per request, and a call past its
deadline would go on in its thread, abandoned, holding a connection.)

Each update is one Lua script (EVALSHA, loaded again on NOSCRIPT by
redis-py's Script), so check and count are atomic across edges; it reads
Redis's own clock (TIME), so edges on different hosts share one. The
window is `edge.limits.window`'s, in a hash `<prefix>w:<name>` (start, req,
tok) that expires after two windows; a key's streams are a sorted set
`<prefix>s:<name>` of leases scored by their expiry. A lease is short
(`[limits] lease_s`, 10 s) and renewed while its request lives: every
`lease_renew_s` one script call re-scores all the leases this process holds
(`renew`). So a stream whose release failed (Redis unreachable at that
moment: the limiter retries it a few times, then leaves it) or whose edge
died is given back within one lease, not after the longest a request may
live.

Every call has a deadline (`timeout_s`); a Redis error or a missed deadline
(`RedisDown`) is `StoreUnavailable`, translated here and only here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

from edge.limits.base import StoreUnavailable
from edge.limits.window import OVER, WINDOW_MS, Decision, Limits
from edge.node.redis import RedisDown, RedisLink

# Mirrors edge.limits.window.admit; limits of 0 are "no limit".
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local rpm, tpm, maxs = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local start = tonumber(redis.call('HGET', KEYS[1], 'start') or '-1')
local req, tok = 0, 0
if start < 0 or now >= start + window or now < start then
  start = now
  redis.call('HSET', KEYS[1], 'start', start, 'req', 0, 'tok', 0)
  redis.call('PEXPIRE', KEYS[1], window * 2)
else
  req = tonumber(redis.call('HGET', KEYS[1], 'req') or '0')
  tok = tonumber(redis.call('HGET', KEYS[1], 'tok') or '0')
end
local streams = 0
if maxs > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  streams = redis.call('ZCARD', KEYS[2])
end
local over = 0
if rpm > 0 and req >= rpm then over = 1
elseif tpm > 0 and tok >= tpm then over = 2
elseif maxs > 0 and streams >= maxs then over = 3
else
  req = redis.call('HINCRBY', KEYS[1], 'req', 1)
  if maxs > 0 then
    local lease = tonumber(ARGV[6])
    redis.call('ZADD', KEYS[2], now + lease, ARGV[5])
    if redis.call('PTTL', KEYS[2]) < lease then redis.call('PEXPIRE', KEYS[2], lease) end
    streams = streams + 1
  end
end
return {over, req, tok, streams, start + window - now}
"""

# Mirrors edge.limits.window.add_tokens.
_ADD_TOKENS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local start = tonumber(redis.call('HGET', KEYS[1], 'start') or '-1')
if start < 0 or now >= start + window or now < start then
  redis.call('HSET', KEYS[1], 'start', now, 'req', 0, 'tok', 0)
  redis.call('PEXPIRE', KEYS[1], window * 2)
end
return redis.call('HINCRBY', KEYS[1], 'tok', tonumber(ARGV[2]))
"""

# Mirrors edge.limits.window.refund, and gives the stream back.
_REFUND = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local start = tonumber(redis.call('HGET', KEYS[1], 'start') or '-1')
if start >= 0 and now >= start and now < start + tonumber(ARGV[1]) then
  if tonumber(redis.call('HGET', KEYS[1], 'req') or '0') > 0 then
    redis.call('HINCRBY', KEYS[1], 'req', -1)
  end
end
return redis.call('ZREM', KEYS[2], ARGV[2])
"""

# KEYS: streams sets; ARGV: the lease (ms), then for each set its count of leases and
# the leases. Each is held another lease from now (added again if it expired meanwhile:
# its request is alive); a set's expiry only ever moves later.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local a = 2
for _, key in ipairs(KEYS) do
  local n = tonumber(ARGV[a])
  for i = a + 1, a + n do
    redis.call('ZADD', key, now + lease, ARGV[i])
  end
  a = a + n + 1
  if n > 0 and redis.call('PTTL', key) < lease then redis.call('PEXPIRE', key, lease) end
end
return a
"""
# Leases re-scored by one script call at most (one call per this many, in a renewal).
_RENEW_BATCH = 1000


class RedisStore:
    """Limits shared through one Redis (see the module doc)."""

    kind = "redis"

    def __init__(self, url: str, *, prefix: str, timeout_s: float, lease_ms: int) -> None:
        self._prefix = prefix
        self._lease_ms = lease_ms
        self._link = link = RedisLink(url, timeout_s=timeout_s)
        self._admit = link.script(_ADMIT)
        self._add_tokens = link.script(_ADD_TOKENS)
        self._refund = link.script(_REFUND)
        self._renew = link.script(_RENEW)

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._link.call(fn, *args, **kwargs)
        except RedisDown as exc:
            raise StoreUnavailable(str(exc)) from None

    async def admit(self, key: str, limits: Limits, lease: str) -> Decision:
        keys = [f"{self._prefix}w:{key}", f"{self._prefix}s:{key}"]
        args = [
            WINDOW_MS, limits.rpm or 0, limits.tpm or 0, limits.max_streams or 0,
            lease, self._lease_ms,
        ]  # fmt: skip
        over, requests, tokens, streams, reset_ms = await self._call(
            self._admit, keys=keys, args=args
        )
        return Decision(
            OVER[over - 1] if over else None, int(requests), int(tokens), int(streams),
            max(0, int(reset_ms)),
        )  # fmt: skip

    async def release(self, key: str, lease: str) -> None:
        await self._call(self._link.client.zrem, f"{self._prefix}s:{key}", lease)

    async def refund(self, key: str, lease: str) -> None:
        keys = [f"{self._prefix}w:{key}", f"{self._prefix}s:{key}"]
        await self._call(self._refund, keys=keys, args=[WINDOW_MS, lease])

    async def renew(self, leases: Mapping[str, Collection[str]]) -> None:
        for keys, args in self._renewals(leases):
            await self._call(self._renew, keys=keys, args=args)

    def _renewals(
        self, leases: Mapping[str, Collection[str]]
    ) -> Iterator[tuple[list[str], list[int | str]]]:
        """The renew script's calls: every lease, at most _RENEW_BATCH per call."""
        keys: list[str] = []
        args: list[int | str] = [self._lease_ms]
        count = 0
        for key, held in leases.items():
            if not held:
                continue
            if count and count + len(held) > _RENEW_BATCH:
                yield keys, args
                keys, args, count = [], [self._lease_ms], 0
            keys.append(f"{self._prefix}s:{key}")
            args.append(len(held))
            args.extend(held)
            count += len(held)
        if keys:
            yield keys, args

    async def add_tokens(self, key: str, tokens: int) -> None:
        if tokens > 0:
            await self._call(
                self._add_tokens, keys=[f"{self._prefix}w:{key}"], args=[WINDOW_MS, tokens]
            )

    def rekey(self, keys: list[tuple[str, Limits]]) -> None:
        pass  # counted by name in Redis: a new key starts empty, one that left is not asked

    async def aclose(self) -> None:
        await self._link.aclose()
