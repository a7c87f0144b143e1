"""The contract tests' gateway: before a real replica on the default model (one process, started
once for the session; few requests, few tokens) and two replica servers over the fake engine: one
with a Qwen3-style template, whose scripted reply makes reasoning and tool calls certain (and
instant), and one that fails mid-stream. Bodies are read raw with httpx (no SDK leniency)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from engine.server import ReplicaServerSettings
from gateway.fleet import embedded
from gateway.settings import GatewaySettings
from gateway.web.app import create_app
from tests.chat.tokenizers import qwen3_like_tokenizer
from tests.engine.server.conftest import ServerThread
from tests.engine.server.fakes import FakeEngine
from tests.gateway.conftest import LoopThread, start_app

FAKE = "fake-model"
FAILING = "fake-failing"  # its replica fails after three tokens: mid-stream errors
REPLY = ('<think>\nThe user asks for the weather.\n</think>\n\n<tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
ASK = [{"role": "user", "content": "Say hi"}]
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}

@pytest.fixture(scope="session")
def default_replica() -> Iterator[Any]:
    """One real replica on the default model, for the session: its ModelSettings."""
    replicas = embedded.start_replicas(1, None, 32 * 1024 * 1024)
    try:
        embedded.wait_healthy(replicas, timeout_s=180)
        yield embedded.model_settings_for(replicas)
    finally:
        embedded.stop_replicas(replicas)


@pytest.fixture(scope="session")
def served(default_replica: Any, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, str]]:
    """(gateway URL, default model name)."""
    loop_thread = LoopThread()
    fake = ServerThread(FakeEngine(tokenizer=qwen3_like_tokenizer(), reply=REPLY,
                                   max_model_len=4096), ReplicaServerSettings())
    failing = ServerThread(FakeEngine(fail_after_num_tokens=3, token_delay_s=0.05),
                           ReplicaServerSettings())
    fake.start()
    failing.start()
    try:
        model = default_replica
        settings = GatewaySettings(
            auth_enabled=False, health_interval_s=0.5, first_token_timeout_s=60, idle_timeout_s=30,
            data_dir=tmp_path_factory.mktemp("contract-gateway"),
            models=[model, {"name": FAKE, "backend": "replica", "endpoints": [fake.base_url]},
                    {"name": FAILING, "backend": "replica", "endpoints": [failing.base_url],
                     "upstream_model": FAKE}])
        runner, url = loop_thread.run(start_app(create_app(settings)))
        yield url, model.name
        loop_thread.run(runner.cleanup())
    finally:
        fake.stop()
        failing.stop()
        loop_thread.close()


@pytest.fixture(scope="session")
def http(served: tuple[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[0] + "/v1", timeout=120) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    answer = http.post(path, json=body)
    return answer.status_code, answer.json()


def sse(http: httpx.Client, path: str, body: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """(event name or None, parsed data) of each SSE event, `[DONE]` left out."""
    events, name = [], None
    with http.stream("POST", path, json={**body, "stream": True}) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append((name, orjson.loads(line[5:])))
                name = None
    return events
