"""Stored responses in Redis: one string key per response with a TTL, and byte totals for the
bounds.

Key layout (the `{resp}` hash tag keeps every key of a script in one Cluster slot):

    aigw:{resp}:r:<member>          string  the body, expiring after ttl_s (PX)
    aigw:{resp}:exp                 zset    member -> expiry (ms): the store's eviction order
    aigw:{resp}:pexp:<project>      zset    the same, one project's
    aigw:{resp}:size                hash    member -> body bytes
    aigw:{resp}:total               string  bytes held in all
    aigw:{resp}:ptotal              hash    project -> bytes held

where member = `<response id>:<project>` (a response id holds no ':'), so a get with another
project's credential names a key that does not exist. Puts and deletes are Lua scripts (atomic
across gateways): a put first drops up to 256 members whose expiry has passed (the key itself is
gone by its TTL; this settles the totals), writes, then evicts the project's, then the store's,
soonest-expiring members until both totals fit. One slot holds every stored response: a Cluster
spreads none of this load.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.responses_store.base import ResponseStore, ResponseStoreSettings

_DROP = """
local function drop(member)
  local project = string.match(member, '^[^:]*:(.*)$')
  local size = redis.call('HGET', KEYS[3], member)
  if size then
    redis.call('DECRBY', KEYS[4], size)
    redis.call('HINCRBY', KEYS[5], project, -tonumber(size))
    redis.call('HDEL', KEYS[3], member)
  end
  redis.call('ZREM', KEYS[1], member)
  redis.call('ZREM', ARGV[1] .. 'pexp:' .. project, member)
  return redis.call('DEL', ARGV[1] .. 'r:' .. member)
end
"""
# KEYS: exp, pexp:<project>, size, total, ptotal
# ARGV: prefix, member, project, body, now_ms, ttl_ms, max_project_bytes, max_bytes
_PUT = _DROP + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[5], 'LIMIT', 0, 256)
for _, member in ipairs(expired) do drop(member) end
local size = string.len(ARGV[4])
local expiry = tonumber(ARGV[5]) + tonumber(ARGV[6])
redis.call('SET', ARGV[1] .. 'r:' .. ARGV[2], ARGV[4], 'PX', ARGV[6])
redis.call('ZADD', KEYS[1], expiry, ARGV[2])
redis.call('ZADD', KEYS[2], expiry, ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], size)
redis.call('INCRBY', KEYS[4], size)
redis.call('HINCRBY', KEYS[5], ARGV[3], size)
local function evict(order, total, max_bytes)
  while tonumber(total() or 0) > max_bytes do
    local oldest = redis.call('ZRANGE', order, 0, 1)
    local victim = oldest[1]
    if victim == ARGV[2] then victim = oldest[2] end
    if not victim then return end
    drop(victim)
  end
end
evict(KEYS[2], function() return redis.call('HGET', KEYS[5], ARGV[3]) end, tonumber(ARGV[7]))
evict(KEYS[1], function() return redis.call('GET', KEYS[4]) end, tonumber(ARGV[8]))
return 1
"""
# KEYS as _PUT; ARGV: prefix, member
_DELETE = _DROP + "return drop(ARGV[2])"


class RedisResponseStore(ResponseStore):
    """`client`: a redis.asyncio client (bytes replies); closed here only if `owns_client`."""

    def __init__(self, settings: ResponseStoreSettings, client: Any, prefix: str = "aigw",
                 owns_client: bool = False) -> None:
        super().__init__(settings)
        self._redis = client
        self._owns_client = owns_client
        self._prefix = f"{prefix}:{{resp}}:"
        self._put = client.register_script(_PUT)
        self._delete = client.register_script(_DELETE)

    def _keys(self, project: str) -> list[str]:
        p = self._prefix
        return [p + "exp", f"{p}pexp:{project}", p + "size", p + "total", p + "ptotal"]

    async def put(self, project: str, response_id: str, body: bytes) -> bool:
        if len(body) > self.settings.max_response_bytes:
            return False
        settings = self.settings
        await self._put(keys=self._keys(project), args=[
            self._prefix, f"{response_id}:{project}", project, body, int(time.time() * 1000),
            max(1, int(settings.ttl_s * 1000)), settings.max_project_bytes, settings.max_bytes])
        return True

    async def get(self, project: str, response_id: str) -> bytes | None:
        value = await self._redis.get(f"{self._prefix}r:{response_id}:{project}")
        if value is None:
            return None
        return value if isinstance(value, bytes) else str(value).encode()

    async def delete(self, project: str, response_id: str) -> bool:
        removed = await self._delete(keys=self._keys(project),
                                     args=[self._prefix, f"{response_id}:{project}"])
        return bool(int(removed))

    async def num_bytes(self) -> int:
        return int(await self._redis.get(self._prefix + "total") or 0)

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()
