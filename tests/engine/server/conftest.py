"""A real replica HTTP server on 127.0.0.1 (port 0), driven from the test thread.

The app runs on its own event loop in a background thread, so tests use ordinary sync clients
(the openai SDK, httpx).

`engine` is the fake by default. To run the suite against another engine, name a zero-argument
factory in AIGW_TEST_SERVER_ENGINE ("package.module:function"; it is called once per test, so
cache a loaded model inside it). Tests that need the fake's knobs (scripted replies, recorded
calls) take `fake_engine` and are skipped for other engines; the rest (test_contract.py, the
error table, ...) hold for any engine that honours the ServedEngine contract.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from engine.server import ReplicaServerSettings, create_app
from tests.engine.server.fakes import FakeEngine


class ServerThread:
    def __init__(self, engine: Any, settings: ReplicaServerSettings) -> None:
        self._engine, self._settings = engine, settings
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-server", daemon=True)
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(timeout=30):
            raise RuntimeError("replica server did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._setup())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())  # type: ignore[union-attr]
        self._loop.close()

    async def _setup(self) -> None:
        app = self.app = create_app(self._engine, self._settings)
        self._runner = web.AppRunner(app, handler_cancellation=self._settings.handler_cancellation)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


ENGINE_FACTORY_ENV = "AIGW_TEST_SERVER_ENGINE"


@pytest.fixture
def engine() -> Any:
    spec = os.environ.get(ENGINE_FACTORY_ENV)
    if not spec:
        return FakeEngine()
    module_name, _, factory = spec.partition(":")
    return getattr(importlib.import_module(module_name), factory)()


@pytest.fixture
def fake_engine(engine: Any) -> FakeEngine:
    if not isinstance(engine, FakeEngine):
        pytest.skip(f"needs the fake engine's knobs ({ENGINE_FACTORY_ENV} is set)")
    return engine


@pytest.fixture
def settings() -> ReplicaServerSettings:
    return ReplicaServerSettings(client_max_size_bytes=1024 * 1024,
                                 served_model_aliases=("fake-alias",))


@pytest.fixture
def server(engine: Any, settings: ReplicaServerSettings) -> Iterator[ServerThread]:
    thread = ServerThread(engine, settings)
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


@pytest.fixture
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                       timeout=30) as sdk:
        yield sdk


@pytest.fixture
def model(engine: Any) -> str:
    return str(engine.model_config.model_id)
