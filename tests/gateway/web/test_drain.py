"""Graceful drain: in-flight streams finish, new requests are refused."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

import gateway.web.app
from bench.mock_upstream import MockConfig, MockState, create_mock_app
from gateway.backends.replica import ReplicaBackend
from gateway.metering.contract import UsageRecord
from gateway.metering.null_meter import NullMeter
from gateway.routing.base import LeastOutstandingRouter
from gateway.settings import GatewaySettings
from gateway.web.app import create_app
from gateway.web.server import drain, gateway_runner
from tests.gateway.conftest import MODEL, LoopThread, start_app, start_runner


async def _start_gateway(upstream: str) -> tuple[web.AppRunner, str]:
    settings = GatewaySettings(auth_enabled=False, drain_timeout_s=10,
                               models=[{"name": MODEL, "endpoints": [upstream]}])
    runner = web.AppRunner(create_app(settings), handler_cancellation=True,
                           shutdown_timeout=settings.drain_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def test_drain_lets_an_in_flight_stream_finish_and_refuses_new_requests(
        loop_thread: LoopThread) -> None:
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


def test_a_stream_cut_by_the_drain_timeout_is_settled_before_the_meter_closes(
        loop_thread: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cut stream's settlement counts its prompt off the event loop first (slow here, as when
    the tokenizer loads on first use); shutdown waits for it before the cleanup that closes the
    meter (gateway/web/services.py puts that one first)."""
    count_prompt_tokens = ReplicaBackend.count_prompt_tokens

    def slow_count(*args: Any) -> int:
        time.sleep(1.5)
        return count_prompt_tokens(*args)

    monkeypatch.setattr(ReplicaBackend, "count_prompt_tokens", slow_count)
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(
        MockState(MockConfig(token_delay_ms=100, num_tokens=100)))))
    meter = NullMeter()
    settled_at_close: dict[str, UsageRecord] = {}

    async def meter_ctx(_: web.Application) -> AsyncIterator[None]:
        yield
        settled_at_close.update(meter.settled)  # what a real meter would still write

    settings = GatewaySettings(auth_enabled=False, models=[
        {"name": MODEL, "backend": "replica", "endpoints": [upstream_url]}])
    app = create_app(settings, meter=meter)
    app.cleanup_ctx.insert(0, meter_ctx)
    runner, url = loop_thread.run(start_app(app))  # shutdown_timeout 1 s
    try:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        expected = httpx.post(url + "/v1/messages/count_tokens", json=chat).json()["input_tokens"]
        with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True},
                          timeout=10) as response:
            request_id = response.headers["x-request-id"]
            next(response.iter_lines())
            loop_thread.run(runner.cleanup())
    finally:
        loop_thread.run(upstream.cleanup())
    assert settled_at_close[request_id].prompt_tokens == expected


def _drain_mid_stream(loop_thread: LoopThread, runner: Any, url: str, upstream: Any
                      ) -> tuple[str, list[str], float, float]:
    """A chat stream through the gateway at `url`, drained (`runner`) after its first line, then
    the upstream's runner cleaned up: (its request id, the lines after the first, seconds from
    the drain's start until the stream ended, and until the drain ended)."""
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
            request_id = response.headers["x-request-id"]
            lines = response.iter_lines()
            next(lines)
            started = time.monotonic()
            draining = asyncio.run_coroutine_threadsafe(drain(runner), loop_thread.loop)
            rest = list(lines)
            ended_s = time.monotonic() - started
            draining.result(30)
            drained_s = time.monotonic() - started
    finally:
        loop_thread.run(upstream.cleanup())
    return request_id, rest, ended_s, drained_s


def test_a_stream_still_running_at_the_drain_deadline_ends_with_the_dialects_error_event(
        loop_thread: LoopThread) -> None:
    """Past drain_timeout_s the stream is ended, not cut: the dialect's error event (503
    `draining`) and no `[DONE]`, so an SDK raises an API error rather than a broken transfer; it
    is settled once, as a stream that failed mid-way is (status 200, finish_reason error)."""
    state = MockState(MockConfig(token_delay_ms=100, num_tokens=300))  # a 30 s stream
    mock_runner, upstream = loop_thread.run(start_app(create_mock_app(state)))
    meter = NullMeter()
    settings = GatewaySettings(auth_enabled=False, drain_timeout_s=1.0,
                               models=[{"name": MODEL, "endpoints": [upstream]}])
    runner, url = loop_thread.run(start_app(create_app(settings, meter=meter)))  # shutdown 1 s
    request_id, rest, ended_s, _ = _drain_mid_stream(loop_thread, runner, url, mock_runner)
    events = [line for line in rest if line.startswith("data: ")]
    assert '"code":"draining"' in events[-1] and "data: [DONE]" not in events
    assert ended_s < 1.9  # at the deadline, not after aiohttp's second wait
    record = meter.settled[request_id]
    assert record.status == 200 and record.finish_reason == "error"
    assert meter.num_settle_calls == 1


def test_aiohttps_own_drain_wait_outlasts_the_deadline_that_ends_the_streams(
        loop_thread: LoopThread, caplog: pytest.LogCaptureFixture) -> None:
    """`aigw serve`'s runner: aiohttp's shutdown wait ends a margin after `drain_timeout_s`, so
    the streams ended at that deadline finish inside it. With both at one instant, a handler
    that finished as aiohttp's wait timed out made aiohttp log 'Unhandled exception ...
    InvalidStateError: invalid state' (its waiter cancelled, not yet cleared): on every drain
    with a stream to a real replica left running (4 of 4 SIGTERMs of `aigw serve`; none after
    the margin). The race needs uvloop's timer resolution and a real upstream's timing, so this
    checks the margin and that the stream still ends at the deadline, not at aiohttp's."""
    caplog.set_level(logging.INFO)
    state = MockState(MockConfig(token_delay_ms=100, num_tokens=300))  # a 30 s stream
    mock_runner, upstream = loop_thread.run(start_app(create_mock_app(state)))
    settings = GatewaySettings(auth_enabled=False, drain_timeout_s=1.0,
                               models=[{"name": MODEL, "endpoints": [upstream]}])
    runner = gateway_runner(create_app(settings, meter=NullMeter()), settings)
    assert runner._shutdown_timeout >= settings.drain_timeout_s + 0.5
    url = loop_thread.run(start_runner(runner))
    _, rest, ended_s, drained_s = _drain_mid_stream(loop_thread, runner, url, mock_runner)
    assert '"code":"draining"' in [line for line in rest if line.startswith("data: ")][-1]
    assert ended_s < 1.9 and drained_s < 1.9  # at the deadline; aiohttp did not wait it out
    assert not [r for r in caplog.records if r.exc_info], caplog.text


class _RouterWhoseCloseHangs(LeastOutstandingRouter):
    """As a router whose Redis index stopped answering: close never returns, cancelled or not."""

    async def close(self) -> None:
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)


def test_a_router_whose_close_hangs_does_not_hold_the_shutdown(
        loop_thread: LoopThread, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(gateway.web.app, "ROUTER_CLOSE_TIMEOUT_S", 0.3)
    settings = GatewaySettings(auth_enabled=False,
                               models=[{"name": MODEL, "endpoints": ["http://127.0.0.1:9"]}])
    runner, _ = loop_thread.run(start_app(create_app(settings, router=_RouterWhoseCloseHangs())))
    started = time.monotonic()
    loop_thread.run(runner.cleanup(), timeout_s=10)
    assert time.monotonic() - started < 5
    assert "the router's close did not finish within 0.3s" in caplog.text
