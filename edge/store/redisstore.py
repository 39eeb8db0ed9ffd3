"""The response store in Redis: responses shared by every edge (and worker) using it.

As the limits' store (`edge.limits.redisstore`), through `edge.node.redis`:
redis-py's asyncio client awaited through the edge's one trio-asyncio bridge, no
retries inside redis-py, a deadline on every call (`timeout_s`), and every error
(`RedisDown`) translated here, once, into `StoreUnavailable`. A record is built in a worker thread
(its JSON can be megabytes); what crosses to Redis is bytes.

Each operation is one Lua script, atomic across edges, on Redis's own clock (TIME),
over seven keys under `prefix` (one hash tag, so a cluster keeps them on one slot),
and one sorted set per owner named from `order` (the same tag, so the same slot):
hashes `resp`, `ctx` (the Response object and its context, by "owner:id"), `items`
(each output item by "owner:item id", its value "owner:id" of its response, a newline,
then the item), `meta` (by "owner:id": the record's bytes, then its item fields, one
a line), the sorted set `order` ("owner:id" scored by when it was stored, in ms) and
the counter `bytes`, the hash `owners` (each owner's bytes) and `order:OWNER` (its
records, as `order`). A write drops what is older than the TTL, replaces the record,
drops the owner's oldest while the owner is over its own count or bytes, then the
oldest while over the count or the bytes; a read sees only records
younger than the TTL (`order`'s score). An owner is a key name, which holds no ':'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import trio

from edge.api.responses_state import Resolved, StoredResponse
from edge.node.redis import RedisDown, RedisLink
from edge.store.base import Bounds, Record, StoreUnavailable, TooMuchReferenced, make_record

# Removes one record (ARGV: its "owner:id"), as a function the other scripts share.
_DROP = """
local function owner_of(k)
  return string.sub(k, 1, string.find(k, ':', 1, true) - 1)
end
local function drop(k)
  local owner = owner_of(k)
  local meta = redis.call('HGET', KEYS[4], k)
  if meta then
    local first = true
    for line in string.gmatch(meta, '[^\\n]+') do
      if first then
        redis.call('DECRBY', KEYS[6], tonumber(line))
        if redis.call('HINCRBY', KEYS[7], owner, -tonumber(line)) <= 0 then
          redis.call('HDEL', KEYS[7], owner)
        end
        first = false
      else
        redis.call('HDEL', KEYS[3], line)
      end
    end
  end
  redis.call('HDEL', KEYS[1], k)
  redis.call('HDEL', KEYS[2], k)
  redis.call('HDEL', KEYS[4], k)
  redis.call('ZREM', KEYS[5] .. ':' .. owner, k)
  return redis.call('ZREM', KEYS[5], k)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# ARGV: ttl ms, max count, max bytes, "owner:id", response, context, nbytes, meta, the
# owner's max count and max bytes, then item field and value pairs.
_PUT = (
    _DROP
    + """
local ttl, maxn, maxb = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local k = ARGV[4]
local owner = owner_of(k)
local mine = KEYS[5] .. ':' .. owner
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now - ttl, 'LIMIT', 0, 256)) do
  drop(old)
end
drop(k)
redis.call('HSET', KEYS[1], k, ARGV[5])
redis.call('HSET', KEYS[2], k, ARGV[6])
redis.call('HSET', KEYS[4], k, ARGV[8])
for i = 11, #ARGV, 2 do
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
end
redis.call('ZADD', KEYS[5], now, k)
redis.call('ZADD', mine, now, k)
redis.call('INCRBY', KEYS[6], tonumber(ARGV[7]))
redis.call('HINCRBY', KEYS[7], owner, tonumber(ARGV[7]))
local omaxn, omaxb = tonumber(ARGV[9]), tonumber(ARGV[10])
while redis.call('ZCARD', mine) > omaxn
    or tonumber(redis.call('HGET', KEYS[7], owner) or '0') > omaxb do
  local oldest = redis.call('ZRANGE', mine, 0, 0)
  if #oldest == 0 then break end
  drop(oldest[1])
end
while redis.call('ZCARD', KEYS[5]) > maxn or tonumber(redis.call('GET', KEYS[6]) or '0') > maxb do
  local oldest = redis.call('ZRANGE', KEYS[5], 0, 0)
  if #oldest == 0 then break end
  drop(oldest[1])
end
return 1
"""
)

# ARGV: ttl ms, "owner:id" (or ""), max bytes, then item fields. Returns {response, context,
# items...}, false for each one missing or expired; -1 (no more read) past the max bytes.
_FETCH = (
    _DROP
    + """
local ttl = tonumber(ARGV[1])
local function alive(k)
  local at = redis.call('ZSCORE', KEYS[5], k)
  return at and tonumber(at) > now - ttl
end
local room = tonumber(ARGV[3])
local out = {false, false}
if ARGV[2] ~= '' and alive(ARGV[2]) then
  out[1] = redis.call('HGET', KEYS[1], ARGV[2])
  out[2] = redis.call('HGET', KEYS[2], ARGV[2])
  if out[1] and out[2] then room = room - #out[1] - #out[2] end
end
for i = 4, #ARGV do
  if room < 0 then return -1 end
  local value = redis.call('HGET', KEYS[3], ARGV[i])
  local cut = value and string.find(value, '\\n', 1, true)
  if cut and alive(string.sub(value, 1, cut - 1)) then
    out[#out + 1] = string.sub(value, cut + 1)
    room = room - (#value - cut)
  else
    out[#out + 1] = false
  end
end
if room < 0 then return -1 end
return out
"""
)

# ARGV: ttl ms, "owner:id". Returns 1 when it was there (and not expired).
_DELETE = (
    _DROP
    + """
local at = redis.call('ZSCORE', KEYS[5], ARGV[2])
if not at or tonumber(at) <= now - tonumber(ARGV[1]) then return 0 end
return drop(ARGV[2])
"""
)


class RedisStore:
    """Responses kept in one Redis (see the module doc)."""

    kind = "redis"

    def __init__(self, url: str, bounds: Bounds, *, prefix: str, timeout_s: float) -> None:
        self._bounds = bounds
        tag = "{" + prefix + "}"  # one hash slot for all six
        self._keys = [
            tag + name for name in ("resp", "ctx", "items", "meta", "order", "bytes", "owners")
        ]
        self._link = link = RedisLink(url, timeout_s=timeout_s)
        self._put = link.script(_PUT)
        self._fetch = link.script(_FETCH)
        self._delete = link.script(_DELETE)

    @property
    def _ttl_ms(self) -> int:
        return int(self._bounds.ttl_s * 1000)

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._link.call(fn, *args, **kwargs)
        except RedisDown as exc:
            raise StoreUnavailable(f"redis: {exc}") from None

    async def put(self, owner: str, response: Mapping[str, Any], context: bytes) -> bool:
        record = await trio.to_thread.run_sync(make_record, owner, response, context)
        if record.nbytes > self._bounds.of(owner)[2]:
            return False
        await self._call(self._put, keys=self._keys, args=self._put_args(record))
        return True

    def _put_args(self, record: Record) -> list[int | str | bytes]:
        k = f"{record.owner}:{record.id}"
        fields = [f"{record.owner}:{item_id}" for item_id, _ in record.items]
        b = self._bounds
        args: list[int | str | bytes] = [
            self._ttl_ms, b.max_responses, b.max_bytes, k, record.response, record.context,
            record.nbytes, "\n".join([str(record.nbytes), *fields]),
            *b.of(record.owner)[:2],
        ]  # fmt: skip
        for field, (_, body) in zip(fields, record.items, strict=True):
            args += [field, k.encode() + b"\n" + body]
        return args

    async def fetch(self, owner: str, response_id: str | None, items: Sequence[str]) -> Resolved:
        k = "" if response_id is None else f"{owner}:{response_id}"
        room = self._bounds.max_response_bytes
        args = [self._ttl_ms, k, room, *(f"{owner}:{item_id}" for item_id in items)]
        out = await self._call(self._fetch, keys=self._keys, args=args)
        if out == -1:
            raise TooMuchReferenced(self._bounds.max_response_bytes)
        response, context, *bodies = out
        previous = None
        if isinstance(response, bytes) and isinstance(context, bytes):
            previous = StoredResponse(response, context)
        found = {i: b for i, b in zip(items, bodies, strict=False) if isinstance(b, bytes)}
        return Resolved(previous, found)

    async def delete(self, owner: str, response_id: str) -> bool:
        args = [self._ttl_ms, f"{owner}:{response_id}"]
        return bool(await self._call(self._delete, keys=self._keys, args=args))

    async def aclose(self) -> None:
        await self._link.aclose()
