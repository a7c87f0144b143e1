"""What the Redis index costs per cached block, measured on the real redis-server.

Run with `-s` to see the figures (bytes per block; MB per million cached tokens at block size 16).
"""

from __future__ import annotations

import random

import redis

from contracts.kv_events import KVSnapshot
from gateway.routing.redis_index import RedisIndex, hash_key
from tests.gateway.routing.conftest import IndexUnderTest

NUM_BLOCKS = 20_000
BLOCK_SIZE = 16


def measure(url: str, num_holders: int) -> tuple[float, float]:
    """(bytes per block by used_memory delta, MEMORY USAGE of one block's hash)."""
    sync = redis.Redis.from_url(url)
    under_test = IndexUnderTest("redis", url)
    rng = random.Random(num_holders)
    hashes = tuple(rng.getrandbits(64) for _ in range(NUM_BLOCKS))
    before = int(sync.info("memory")["used_memory"])
    for holder in range(num_holders):
        under_test.run(under_test.index.load_snapshot(KVSnapshot(f"10.0.0.{holder}:8001", 1, 16,
                                                                 hashes)))
    after = int(sync.info("memory")["used_memory"])
    assert isinstance(under_test.index, RedisIndex)
    one_key = int(sync.memory_usage(under_test.index.block_prefix + hash_key(hashes[0])) or 0)
    under_test.close()
    sync.close()
    return (after - before) / NUM_BLOCKS, float(one_key)


def test_memory_per_cached_block_is_bounded(clean_redis_url: str) -> None:
    per_block, key_bytes = measure(clean_redis_url, 1)
    mb_per_million_tokens = per_block * 1_000_000 / BLOCK_SIZE / 1e6
    print(f"\nredis index, 1 holder: {per_block:.0f} B/block (hash key alone {key_bytes:.0f} B), "
          f"{mb_per_million_tokens:.1f} MB per million cached tokens")
    redis.Redis.from_url(clean_redis_url).flushall()
    per_block_2, key_bytes_2 = measure(clean_redis_url, 2)
    print(f"redis index, 2 holders of every block: {per_block_2:.0f} B/block "
          f"(hash key {key_bytes_2:.0f} B)")
    assert 40 < per_block < 400
    assert per_block_2 < 2 * per_block
