"""Measure what aigw keeps in Redis, per key, request and replica (docs/deploy.md, "Memory").

    .venv/bin/python -m tests.deploy.redis_memory          # starts its own redis-server

Writes through the real code paths (auth's RedisKeyStore, the RedisMeter's Lua scripts, the
replica's RedisEventPublisher) into an empty redis-server, then reads `INFO memory`'s
used_memory before and after, and `MEMORY USAGE` of sample keys. A measurement, not a test.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import redis as sync_redis
import redis.asyncio as aioredis

from auth import AuthSettings, open_auth
from auth.principal import Principal
from contracts.kv_events import BlockStored, EventBatch
from engine.kv_cache.redis_publisher import RedisEventPublisher
from gateway.metering import Limits, MeteringSettings, ModelPrice, UsageRecord, open_meter
from tests.redis_server import running_redis_server

NUM_KEYS = 500
NUM_REQUESTS = 5_000
NUM_BATCHES = 2_000
BLOCKS_PER_BATCH = 4  # a 64-token prompt's worth of blocks stored in one engine step
BLOCK_SIZE = 16


def _used(client: sync_redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


async def _keys(url: str, client: sync_redis.Redis) -> tuple[float, int]:
    services = await open_auth(AuthSettings(enabled=False, redis_url=url))
    try:
        await services.admin.create_project("measure")
        before = _used(client)
        for i in range(NUM_KEYS):
            await services.admin.create_key("measure", ["ai_gateway:invoke"], name=f"k{i}")
        per_key = (_used(client) - before) / NUM_KEYS
        sample = next(k for k in client.scan_iter("aigw:auth:key:*"))
        return per_key, int(client.memory_usage(sample) or 0)
    finally:
        await services.close()


async def _usage(url: str, client: sync_redis.Redis) -> tuple[float, int]:
    settings = MeteringSettings(prices={"m": ModelPrice(input=0.1, output=0.4)},
                                default_project_limits=Limits(requests_per_minute=10**9,
                                                              tokens_per_minute=10**12))
    redis = aioredis.Redis.from_url(url, decode_responses=True)
    meter = await open_meter(settings, redis=redis)
    principal = Principal(project="measure", key_id="key1", scopes=frozenset({"ai_gateway:invoke"}))
    try:
        before = _used(client)
        for _ in range(NUM_REQUESTS):
            request_id = "chatcmpl-" + uuid.uuid4().hex
            admission = await meter.admit(request_id, principal, "m", 1200, 200)
            await meter.settle(admission, UsageRecord(
                request_id=request_id, project="measure", key_id="key1", model="m",
                endpoint="aigw-replica-0.aigw-replica.aigw.svc.cluster.local:8001",
                prompt_tokens=1200, cached_tokens=1024, completion_tokens=180, cost_usd=0.0002,
                latency_ms=850.0, status=200, created_at=time.time(), stream=True,
                finish_reason="stop"))
        per_request = (_used(client) - before) / NUM_REQUESTS
        sample = next(k for k in client.scan_iter("aigw:*:usage:req:*"))
        return per_request, int(client.memory_usage(sample) or 0)
    finally:
        await meter.close()
        await redis.aclose()


def _stream(url: str, client: sync_redis.Redis) -> float:
    publisher = RedisEventPublisher(url, "aigw-replica-0", max_stream_len=NUM_BATCHES * 2)
    before = _used(client)
    for seq in range(NUM_BATCHES):
        hashes = tuple(uuid.uuid4().int >> 64 for _ in range(BLOCKS_PER_BATCH))
        tokens = tuple(range(BLOCK_SIZE * BLOCKS_PER_BATCH))
        publisher.publish(EventBatch("aigw-replica-0", seq, time.time(), (
            BlockStored(hashes, None, tokens, BLOCK_SIZE),)))
    publisher.close(timeout_s=30)
    assert client.xlen(publisher.stream_key) == NUM_BATCHES, "the publisher dropped batches"
    return (_used(client) - before) / NUM_BATCHES


def main() -> None:
    with running_redis_server() as url:
        client = sync_redis.Redis.from_url(url)
        print(f"redis {client.info('server')['redis_version']}")
        per_key, key_usage = asyncio.run(_keys(url, client))
        print(f"API key: {per_key:.0f} B each (used_memory), record MEMORY USAGE {key_usage} B")
        per_request, record_usage = asyncio.run(_usage(url, client))
        print(f"usage per request: {per_request:.0f} B (used_memory), "
              f"record MEMORY USAGE {record_usage} B")
        per_batch = _stream(url, client)
        print(f"KV event stream: {per_batch:.0f} B per batch of {BLOCKS_PER_BATCH} stored blocks")


if __name__ == "__main__":
    main()
