"""A real redis-server for tests: started on a free port in a temp dir, stopped afterwards.

scripts/ensure-redis.sh installs the binary where it is missing. Never a fake Redis: the Lua
scripts, pub/sub and expiry under test are Redis's own.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager


def free_port(also_free_at: int = 0) -> int:
    """A free loopback port; with `also_free_at`, one whose port + `also_free_at` is free and
    below 65536 too (a cluster node's bus listens 10,000 above its port: redis-server refuses
    a port over 55535 in cluster mode, and ~19% of the kernel's ephemeral ports are)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not also_free_at:
            return port
        if port + also_free_at < 65536:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bus:
                try:
                    bus.bind(("127.0.0.1", port + also_free_at))
                except OSError:
                    continue
            return port


def ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_process(binary: str, workdir: str, extra_args: tuple[str, ...] = (),
                  startup_timeout_s: float = 10.0, bus_port_offset: int = 0) -> Iterator[int]:
    """One redis-server on a free loopback port (no persistence), answering PING; yields the port.
    `bus_port_offset`: a cluster node's, whose bus port must be free (and in range) too."""
    for _attempt in range(3):  # the free port may be taken between probe and bind
        port = free_port(bus_port_offset)
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir, *extra_args,
             "--save", "", "--appendonly", "no", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir)
        deadline = time.monotonic() + startup_timeout_s
        while process.poll() is None and time.monotonic() < deadline and not ping(port):
            time.sleep(0.02)
        if process.poll() is None and ping(port):
            break
        process.kill()
        process.wait()
    else:
        raise RuntimeError("redis-server did not start")
    try:
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def running_redis_server(startup_timeout_s: float = 10.0) -> Iterator[str]:
    """Yield `redis://127.0.0.1:<port>/0` of a fresh redis-server (no persistence)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not on PATH: run scripts/ensure-redis.sh")
    with tempfile.TemporaryDirectory(prefix="aigw-redis-") as workdir, \
            redis_process(binary, workdir, startup_timeout_s=startup_timeout_s) as port:
        yield f"redis://127.0.0.1:{port}/0"


def flush_all(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()

