"""The test suite's own Redis helpers (tests/redis_server.py, tests/redis_cluster.py)."""

from __future__ import annotations

import socket

from tests.redis_cluster import CLUSTER_BUS_PORT_OFFSET
from tests.redis_server import free_port


def test_a_cluster_node_port_leaves_room_for_its_bus_port() -> None:
    """A fresh-clone CI run lost every Redis Cluster test to 'redis-server did not start': ~19% of
    the kernel's ephemeral ports are over 55535, which redis-server refuses in cluster mode."""
    for _ in range(300):
        port = free_port(CLUSTER_BUS_PORT_OFFSET)
        assert port + CLUSTER_BUS_PORT_OFFSET <= 65535
        with socket.socket() as bus:
            bus.bind(("127.0.0.1", port + CLUSTER_BUS_PORT_OFFSET))
