"""`serve` runs the app on a given host/port until cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import aiohttp

from engine.server import ReplicaServerSettings, serve
from tests.engine.server.fakes import FakeEngine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _get_health_until_up(url: str) -> dict[str, str]:
    async with aiohttp.ClientSession() as session:
        for _ in range(200):  # bounded: up to ~10 s for the site to start
            try:
                async with session.get(url) as response:
                    return await response.json()  # type: ignore[no-any-return]
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
    raise AssertionError("server never came up")


def test_serve_answers_until_cancelled() -> None:
    port = free_port()

    async def main() -> dict[str, str]:
        task = asyncio.create_task(serve(FakeEngine(), "127.0.0.1", port, ReplicaServerSettings()))
        try:
            return await _get_health_until_up(f"http://127.0.0.1:{port}/health")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    assert asyncio.run(main()) == {"status": "ok"}
