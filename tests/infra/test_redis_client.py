"""infra/redis_client.py against a real Redis Cluster."""

from __future__ import annotations

import asyncio

from infra.redis_client import connect_redis, connect_redis_sync


def _moved_answers(url: str) -> int:
    """How many MOVED errors the cluster's primaries have answered since their last RESETSTAT."""
    from redis.cluster import RedisCluster

    client = connect_redis_sync(url)
    try:
        stats = client.info("errorstats", target_nodes=RedisCluster.PRIMARIES)
    finally:
        client.close()
    per_node = stats.values() if all(isinstance(v, dict) for v in stats.values()) else [stats]
    return sum(int(node.get("errorstat_MOVED", {}).get("count", 0)) for node in per_node)


def test_a_fresh_cluster_client_sends_its_first_keyed_commands_to_the_slot_owner(
        clean_redis_cluster_url: str) -> None:
    """redis-py's asyncio cluster client, before it has learned the slot map, sent keyed commands
    to a random primary: MOVED, and after a few of those it closed every connection, in-flight
    ones too (a budget test on the cluster failed with AttributeError under load)."""
    from redis.cluster import RedisCluster

    admin = connect_redis_sync(clean_redis_cluster_url)
    try:
        admin.config_resetstat(target_nodes=RedisCluster.PRIMARIES)
    finally:
        admin.close()

    async def first_commands() -> None:
        for _ in range(4):
            client = connect_redis(clean_redis_cluster_url, decode_responses=True)
            try:
                keys = [f"aigw:{{p:tenant-{i}}}:usage:days" for i in range(12)]
                assert await asyncio.gather(*(client.smembers(k) for k in keys)) == [set()] * 12
            finally:
                await client.aclose()

    asyncio.run(first_commands())
    assert _moved_answers(clean_redis_cluster_url) == 0
