"""A real three-node Redis Cluster for tests: three redis-server processes in cluster mode on free
ports, joined by `redis-cli --cluster create` (no replicas), stopped afterwards.

scripts/ensure-redis.sh installs redis-server and redis-cli (Debian's redis-server package ships
both). The URL handed out is `redis+cluster://127.0.0.1:<first port>` (infra/redis_client.py).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from tests.redis_server import redis_process

NUM_NODES = 3
CLUSTER_BUS_PORT_OFFSET = 10_000  # redis-server's cluster bus: its port + 10,000


@contextmanager
def _node(binary: str, workdir: str, startup_timeout_s: float) -> Iterator[int]:
    with redis_process(binary, workdir, ("--cluster-enabled", "yes", "--cluster-config-file",
                                         f"nodes-{time.monotonic_ns()}.conf"),
                       startup_timeout_s, bus_port_offset=CLUSTER_BUS_PORT_OFFSET) as port:
        yield port


def _cluster_ok(cli: str, port: int) -> bool:
    info = subprocess.run([cli, "-h", "127.0.0.1", "-p", str(port), "cluster", "info"],
                          capture_output=True, text=True, timeout=5, check=False).stdout
    return "cluster_state:ok" in info


@contextmanager
def running_redis_cluster(startup_timeout_s: float = 20.0) -> Iterator[str]:
    """Yield `redis+cluster://127.0.0.1:<port>` of a fresh three-primary cluster."""
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        raise RuntimeError("redis-server/redis-cli not on PATH: run scripts/ensure-redis.sh")
    with tempfile.TemporaryDirectory(prefix="aigw-redis-cluster-") as workdir, ExitStack() as stack:
        ports = [stack.enter_context(_node(binary, workdir, startup_timeout_s))
                 for _ in range(NUM_NODES)]
        created = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=30, check=False)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-500:]}"
                               f"{created.stderr[-500:]}")
        deadline = time.monotonic() + startup_timeout_s
        while not all(_cluster_ok(cli, p) for p in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        yield f"redis+cluster://127.0.0.1:{ports[0]}"


def flush_cluster(url: str) -> None:
    """FLUSHALL on every primary of the cluster at `url`."""
    from redis.cluster import RedisCluster

    from infra.redis_client import connect_redis_sync

    client = connect_redis_sync(url)
    try:
        client.flushall(target_nodes=RedisCluster.PRIMARIES)
    finally:
        client.close()


# Store params of the parametrized store fixtures -> the fixture that yields a flushed URL.
CLEAN_REDIS_FIXTURES = {"redis": "clean_redis_url", "redis-cluster": "clean_redis_cluster_url"}


def clean_url_for(kind: str, request: pytest.FixtureRequest) -> str | None:
    """A flushed Redis (or Redis Cluster) URL for a store param; None for embedded stores."""
    fixture = CLEAN_REDIS_FIXTURES.get(kind)
    return None if fixture is None else str(request.getfixturevalue(fixture))
