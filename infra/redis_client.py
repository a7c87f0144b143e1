"""The one place a Redis client is built from a URL (auth store, meter, prefix index, streams).

    redis://host:port/0            one Redis server: redis.asyncio.Redis
    rediss://...                   the same over TLS
    redis+cluster://host:port      a Redis Cluster, discovered from that seed node:
                                   redis.asyncio.cluster.RedisCluster (no database number;
                                   rediss+cluster:// for TLS)

Every multi-key script or pipeline in this project keeps the keys of one call under one hash
tag (`aigw:{p:<project>}:...` for a project's usage and limits, `aigw:{kv}:...` for the prefix
index), so the same code runs on one server and on a cluster.
"""

from __future__ import annotations

import functools
from typing import Any
from urllib.parse import urlsplit, urlunsplit

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SCHEMES = ("redis", "rediss", "unix", *_CLUSTER_SCHEMES)


def check_redis_url(url: str) -> str:
    """`url`, or a ValueError naming the schemes this module connects to, or saying its port is
    not one (settings validate it, so a typo fails at start with one line, not in a replica or a
    worker with a traceback; redis-py's from_url raises a bare ValueError for the port)."""
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:  # (not the URL in the message: it may hold a password)
        raise ValueError(f"a Redis URL starts with {', '.join(s + '://' for s in _SCHEMES)}, "
                         f"not {parts.scheme + ':' if parts.scheme else 'no scheme'}")
    try:
        parts.port  # noqa: B018 - parsed for its ValueError
    except ValueError:  # not urllib's message: `redis://user:secret` (no @host) has port "secret"
        raise ValueError("the port in the Redis URL is not a number in 0..65535") from None
    return url


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in _CLUSTER_SCHEMES


def _plain_url(url: str) -> str:
    """The cluster URL with its scheme replaced by the one redis-py parses (redis/rediss)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=_CLUSTER_SCHEMES[parts.scheme]))


def is_cluster_client(client: Any) -> bool:
    """True for a redis-py (asyncio or blocking) RedisCluster client."""
    from redis.asyncio.cluster import RedisCluster
    from redis.cluster import RedisCluster as SyncRedisCluster

    return isinstance(client, RedisCluster | SyncRedisCluster)


def connect_redis(url: str, *, decode_responses: bool = False, **options: Any) -> Any:
    """An asyncio client for `url`: RedisCluster for redis+cluster://, else Redis. `options` go to
    the client (e.g. socket_timeout). The caller closes it with `await client.aclose()`."""
    if is_cluster_url(url):
        return _cluster_client_class().from_url(_plain_url(url),
                                                decode_responses=decode_responses, **options)
    import redis.asyncio

    return redis.asyncio.Redis.from_url(url, decode_responses=decode_responses, **options)


@functools.cache
def _cluster_client_class() -> Any:
    """redis-py's asyncio RedisCluster, learning the cluster's slot map before its first command.

    The stock client picks a command's node before it has initialized: with no default node yet,
    a keyed command (SMEMBERS, GET, ...) is taken for keyless and sent to a random primary. The
    primary answers MOVED, and every few MOVED the client closes all its connections, in-flight
    ones too (a concurrent command mid-handshake then fails with AttributeError). The blocking
    client initializes in its constructor, so it has no such window."""
    from redis.asyncio.cluster import RedisCluster

    class InitializedRedisCluster(RedisCluster):
        async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
            if self._initialize:
                await self.initialize()
            return await super().execute_command(*args, **kwargs)

    return InitializedRedisCluster


def connect_redis_sync(url: str, *, decode_responses: bool = False, **options: Any) -> Any:
    """The blocking twin of `connect_redis` (for threads outside an event loop)."""
    if is_cluster_url(url):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(_plain_url(url), decode_responses=decode_responses,
                                     **options)
    import redis

    return redis.Redis.from_url(url, decode_responses=decode_responses, **options)
