"""Graceful drain: in-flight streams finish, new requests are refused."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from aiohttp import web

from bench.mock_upstream import MockConfig, MockState, create_mock_app
from gateway.app import create_app
from gateway.server import drain
from gateway.settings import GatewaySettings
from tests.gateway.conftest import MODEL, LoopThread, start_app


async def _start_gateway(upstream: str) -> tuple[web.AppRunner, str]:
    settings = GatewaySettings(auth_enabled=False, drain_timeout_s=10,
                               models=[{"name": MODEL, "endpoints": [upstream]}])
    runner = web.AppRunner(create_app(settings), handler_cancellation=True,
                           shutdown_timeout=settings.drain_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def test_drain_lets_an_in_flight_stream_finish_and_refuses_new_requests(loop_thread: LoopThread) -> None:
    state = MockState(MockConfig(token_delay_ms=50, num_tokens=20))
    mock_runner, upstream = loop_thread.run(start_app(create_mock_app(state)))
    runner, url = loop_thread.run(_start_gateway(upstream))
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    received: list[str] = []
    client = threading.Thread(target=lambda: received.append(
        httpx.post(url + "/v1/chat/completions", json=body, timeout=30).text))
    client.start()
    deadline = time.monotonic() + 10
    while state.num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    draining = asyncio.run_coroutine_threadsafe(drain(runner), loop_thread.loop)
    time.sleep(0.2)
    try:
        late = httpx.post(url + "/v1/chat/completions", json=body, timeout=5)
        assert late.status_code == 503
    except httpx.ConnectError:
        pass  # the listener is already closed: refused, as it should be
    client.join(30)
    draining.result(30)
    assert received and received[0].count("tok ") == 20 and received[0].endswith("data: [DONE]\n\n")
    loop_thread.run(mock_runner.cleanup())
