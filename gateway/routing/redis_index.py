"""The prefix index in Redis, shared by every gateway instance (the contract:
gateway/routing/index.py).

Key layout (`<p>` = the key prefix, default "aigw"; every key carries the hash tag `{kv}`, so the
whole index lives in ONE cluster slot and every Lua script below is cluster-safe):

    <p>:{kv}:b:<hash>      HASH  replica_id -> expiry in ms since the epoch (Redis TIME), "0" = held
                                  (from events) until removed; <hash> = 16 lowercase hex digits
    <p>:{kv}:r:<replica>   SET   the <hash>es this replica has entries in (drop in O(its blocks))
    <p>:{kv}:seq           HASH  replica_id -> seq of the last event batch applied
    <p>:{kv}:h:<hash>      SET   replica_ids whose host tier holds the block (events with medium
                                 "host")
    <p>:{kv}:hr:<replica>  SET   the <hash>es this replica's host tier holds

Every operation is one round trip (one EVALSHA). `match` walks the request's blocks in order and
stops at the first block no candidate still in its run holds (in either tier; `match_tiers` also
counts the blocks of each run only the host tier holds). Expired tentative entries are
ignored by `match` and removed when the replica's entries are cleared (snapshot, drop, reset).
Measured memory (tests/gateway/routing/test_redis_memory.py, redis 7.0, 20,000 random blocks):
218 bytes per cached block held by one replica (the block's hash key ~104 B by MEMORY USAGE, the
rest the replica-set member and dict overhead), 309 B when two replicas hold every block; i.e.
13.6 MB per million cached tokens at block_size 16 (one holder).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contracts.kv_events import (
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockRetained,
    BlockStored,
    EventBatch,
    KVSnapshot,
)
from gateway.routing.index import ApplyResult, PrefixIndex

_CLEAR = """
local function clear(set_key, replica, block_prefix)
  for _, h in ipairs(redis.call('SMEMBERS', set_key)) do
    redis.call('HDEL', block_prefix .. h, replica)
  end
  redis.call('DEL', set_key)
end
local function clear_host(set_key, replica, host_prefix)
  for _, h in ipairs(redis.call('SMEMBERS', set_key)) do
    redis.call('SREM', host_prefix .. h, replica)
  end
  redis.call('DEL', set_key)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: seq hash, replica set, host replica set. ARGV: replica, seq, block prefix, host prefix,
# then ops: S n h.. | R n h.. | HS n h.. | HR n h.. (the host tier's) | C (both tiers)
_APPLY = _CLEAR + """
local replica, seq, bp, hp = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local applied = redis.call('HGET', KEYS[1], replica)
if not applied or seq > tonumber(applied) + 1 then return 'gap' end
if seq <= tonumber(applied) then return 'stale' end
local i = 5
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    clear(KEYS[2], replica, bp); clear_host(KEYS[3], replica, hp); i = i + 1
  else
    local n = tonumber(ARGV[i + 1])
    for j = i + 2, i + 1 + n do
      if op == 'S' then
        redis.call('HSET', bp .. ARGV[j], replica, '0'); redis.call('SADD', KEYS[2], ARGV[j])
      elseif op == 'R' then
        redis.call('HDEL', bp .. ARGV[j], replica); redis.call('SREM', KEYS[2], ARGV[j])
      elseif op == 'HS' then
        redis.call('SADD', hp .. ARGV[j], replica); redis.call('SADD', KEYS[3], ARGV[j])
      else
        redis.call('SREM', hp .. ARGV[j], replica); redis.call('SREM', KEYS[3], ARGV[j])
      end
    end
    i = i + 2 + n
  end
end
redis.call('HSET', KEYS[1], replica, seq)
return 'applied'
"""

# KEYS: seq hash, replica set, host replica set. ARGV: replica, seq ('' = drop), block prefix,
# host prefix, number of pool hashes n, n pool hashes..., host tier hashes...
_RESET = _CLEAR + """
local replica, bp, hp = ARGV[1], ARGV[3], ARGV[4]
clear(KEYS[2], replica, bp)
clear_host(KEYS[3], replica, hp)
if ARGV[2] == '' then redis.call('HDEL', KEYS[1], replica); return 0 end
local last_main = 5 + tonumber(ARGV[5])
for i = 6, last_main do
  redis.call('HSET', bp .. ARGV[i], replica, '0'); redis.call('SADD', KEYS[2], ARGV[i])
end
for i = last_main + 1, #ARGV do
  redis.call('SADD', hp .. ARGV[i], replica); redis.call('SADD', KEYS[3], ARGV[i])
end
redis.call('HSET', KEYS[1], replica, ARGV[2])
return #ARGV - 5
"""

# KEYS: replica set. ARGV: replica, ttl ms, block prefix, hashes...
_TENTATIVE = _CLEAR + """
local replica, expiry, bp = ARGV[1], now_ms() + tonumber(ARGV[2]), ARGV[3]
for i = 4, #ARGV do
  if redis.call('HGET', bp .. ARGV[i], replica) ~= '0' then
    redis.call('HSET', bp .. ARGV[i], replica, expiry); redis.call('SADD', KEYS[1], ARGV[i])
  end
end
return 0
"""

# KEYS: seq hash (unread: it routes the call to the {kv} slot on a cluster). ARGV: block prefix,
# host prefix, number of replicas, replicas..., hashes...  -> {replica, run, host-only blocks, ...}
_MATCH = _CLEAR + """
local bp, hp, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
local alive, runs, hosted = {}, {}, {}
for i = 4, 3 + n do alive[ARGV[i]] = true; runs[ARGV[i]] = 0; hosted[ARGV[i]] = 0 end
local position = 0
for i = 4 + n, #ARGV do
  position = position + 1
  local fields = redis.call('HGETALL', bp .. ARGV[i])
  local holders = {}
  for j = 1, #fields, 2 do
    local expiry = tonumber(fields[j + 1])
    if expiry == 0 or expiry > now then holders[fields[j]] = true end
  end
  local host = {}
  for _, replica in ipairs(redis.call('SMEMBERS', hp .. ARGV[i])) do host[replica] = true end
  local any = false
  for replica, _ in pairs(alive) do
    if holders[replica] or host[replica] then
      runs[replica] = position; any = true
      if not holders[replica] then hosted[replica] = hosted[replica] + 1 end
    else
      alive[replica] = nil
    end
  end
  if not any then break end
end
local out = {}
for replica, run in pairs(runs) do
  out[#out + 1] = replica; out[#out + 1] = run; out[#out + 1] = hosted[replica]
end
return out
"""

# KEYS: replica set. ARGV: replica, block prefix -> live entries
_COUNT = _CLEAR + """
local now, count = now_ms(), 0
for _, h in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local expiry = redis.call('HGET', ARGV[2] .. h, ARGV[1])
  if expiry and (tonumber(expiry) == 0 or tonumber(expiry) > now) then count = count + 1 end
end
return count
"""


def hash_key(block_hash: int) -> str:
    return format(block_hash, "016x")


class RedisIndex(PrefixIndex):
    """`client` is a `redis.asyncio.Redis` (decode_responses either way); it is not closed here
    unless `owns_client`."""

    def __init__(self, client: Any, prefix: str = "aigw", owns_client: bool = False) -> None:
        self._redis = client
        self._owns_client = owns_client
        self.block_prefix = f"{prefix}:{{kv}}:b:"
        self.replica_prefix = f"{prefix}:{{kv}}:r:"
        self.seq_key = f"{prefix}:{{kv}}:seq"
        self.host_prefix = f"{prefix}:{{kv}}:h:"
        self.host_replica_prefix = f"{prefix}:{{kv}}:hr:"
        self._apply = client.register_script(_APPLY)
        self._reset = client.register_script(_RESET)
        self._tentative = client.register_script(_TENTATIVE)
        self._match = client.register_script(_MATCH)
        self._count = client.register_script(_COUNT)

    @classmethod
    def from_url(cls, url: str, prefix: str = "aigw") -> RedisIndex:
        from infra.redis_client import connect_redis

        return cls(connect_redis(url), prefix, owns_client=True)

    async def apply(self, batch: EventBatch) -> ApplyResult:
        ops: list[str | int] = []
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                ops.append("C")
            else:
                op = "S" if isinstance(event, BlockStored | BlockRetained) else "R"
                if isinstance(event, BlockStored | BlockRemoved) and event.medium == MEDIUM_HOST:
                    op = "H" + op
                ops += [op, len(event.block_hashes)]
                ops += [hash_key(h) for h in event.block_hashes]
        result = await self._apply(keys=self._replica_keys(batch.replica_id),
                                   args=[batch.replica_id, batch.seq, self.block_prefix,
                                         self.host_prefix, *ops])
        return ApplyResult(_text(result))

    def _replica_keys(self, replica_id: str) -> list[str]:
        return [self.seq_key, self.replica_prefix + replica_id,
                self.host_replica_prefix + replica_id]

    async def load_snapshot(self, snapshot: KVSnapshot) -> None:
        await self._reset(keys=self._replica_keys(snapshot.replica_id),
                          args=[snapshot.replica_id, snapshot.seq, self.block_prefix,
                                self.host_prefix, len(snapshot.block_hashes),
                                *(hash_key(h) for h in snapshot.block_hashes),
                                *(hash_key(h) for h in snapshot.host_block_hashes)])

    async def drop_replica(self, replica_id: str) -> None:
        await self._reset(keys=self._replica_keys(replica_id),
                          args=[replica_id, "", self.block_prefix, self.host_prefix, 0])

    async def applied_seq(self, replica_id: str) -> int | None:
        value = await self._redis.hget(self.seq_key, replica_id)
        return None if value is None else int(value)

    async def match(self, block_hashes: Sequence[int],
                    replica_ids: Sequence[str]) -> dict[str, int]:
        return {r: run
                for r, (run, _) in (await self.match_tiers(block_hashes, replica_ids)).items()}

    async def match_tiers(self, block_hashes: Sequence[int], replica_ids: Sequence[str]
                          ) -> dict[str, tuple[int, int]]:
        if not block_hashes or not replica_ids:
            return dict.fromkeys(replica_ids, (0, 0))
        flat = await self._match(keys=[self.seq_key],
                                 args=[self.block_prefix, self.host_prefix, len(replica_ids),
                                       *replica_ids, *(hash_key(h) for h in block_hashes)])
        return {_text(flat[i]): (int(flat[i + 1]), int(flat[i + 2]))
                for i in range(0, len(flat), 3)}

    async def insert_tentative(self, replica_id: str, block_hashes: Sequence[int],
                               ttl_s: float) -> None:
        if block_hashes:
            await self._tentative(keys=[self.replica_prefix + replica_id],
                                  args=[replica_id, int(ttl_s * 1000), self.block_prefix,
                                        *(hash_key(h) for h in block_hashes)])

    async def num_blocks(self, replica_id: str) -> int:
        return int(await self._count(keys=[self.replica_prefix + replica_id],
                                     args=[replica_id, self.block_prefix]))

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
