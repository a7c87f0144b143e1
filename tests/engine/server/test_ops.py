"""Operations endpoints: health, models, metrics, KV events/snapshot, admin-only KV reset."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from aiohttp.test_utils import make_mocked_request

from contracts.replica_errors import PermissionDeniedError
from engine.server.handlers.ops import kv_reset
from engine.server.keys import SERVING_KEY
from engine.server.settings import ReplicaServerSettings
from tests.engine.server.conftest import ServerThread
from tests.engine.server.fakes import FakeEngine

USER = [{"role": "user", "content": "hi"}]


def test_health_is_ok_while_the_engine_is_alive(http: httpx.Client,
                                                fake_engine: FakeEngine) -> None:
    response = http.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    fake_engine.is_alive = False
    assert http.get("/health").status_code == 503


def test_models_lists_the_served_model_and_aliases(client: openai.OpenAI, http: httpx.Client,
                                                   engine: Any, model: str) -> None:
    assert [m.id for m in client.models.list()] == [model, "fake-alias"]
    first = http.get("/v1/models").json()["data"][0]
    assert first["owned_by"] == "aigw" and first["max_model_len"] == engine.max_model_len


def test_metrics_expose_engine_state_and_latencies(client: openai.OpenAI, http: httpx.Client,
                                                   engine: Any, model: str) -> None:
    client.chat.completions.create(model=model, messages=USER)  # type: ignore[arg-type]
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("aigw_replica_num_requests_running", "aigw_replica_num_requests_waiting",
                 "aigw_replica_kv_blocks_used", "aigw_replica_kv_blocks_total",
                 "aigw_replica_kv_blocks_cached",
                 "aigw_replica_prompt_tokens_total", "aigw_replica_generation_tokens_total",
                 "aigw_replica_prefix_cache_queried_tokens_total",
                 "aigw_replica_prefix_cache_hit_tokens_total",
                 "aigw_replica_prefix_cache_hit_ratio", "aigw_replica_preemptions_total",
                 "aigw_replica_time_to_first_token_seconds_bucket",
                 "aigw_replica_inter_token_latency_seconds_bucket",
                 "aigw_replica_e2e_request_latency_seconds_count"):
        assert f"\n{name}{{" in text, name
    finished = re.findall(r'\naigw_replica_requests_total\{finish_reason="(\w+)",'
                          rf'model="{re.escape(model)}",'
                          rf'replica="{re.escape(engine.replica_id)}"\}} 1.0',
                          text)
    assert finished in (["stop"], ["length"])


def test_two_apps_keep_separate_metric_registries(engine: Any) -> None:
    settings = ReplicaServerSettings()
    first, second = ServerThread(engine, settings), ServerThread(engine, settings)
    first.start()
    second.start()  # a global registry would reject the second app's duplicate metrics
    first.stop()
    second.stop()


def test_kv_events_and_snapshot_delegate_to_the_engine(http: httpx.Client) -> None:
    assert http.get("/kv/events", params={"since": 5}).json()["next_seq"] == 5
    assert http.get("/kv/events").json()["next_seq"] == 0
    assert http.get("/kv/events", params={"since": "-1"}).status_code == 400
    for since in ("²", "9" * 5000):  # str.isdigit() takes both, int() neither: they were 500s
        assert http.get("/kv/events", params={"since": since}).status_code == 400
    assert http.get("/kv/snapshot").json()["block_hashes"] == []


def test_kv_reset_without_token_is_allowed_from_loopback(http: httpx.Client,
                                                         fake_engine: FakeEngine) -> None:
    response = http.post("/kv/reset")
    assert response.status_code == 200 and response.json() == {"reset": True}
    assert fake_engine.num_prefix_cache_resets == 1


class TestKvResetWithSecret:
    @pytest.fixture
    def settings(self) -> ReplicaServerSettings:
        return ReplicaServerSettings(secret="s3cret")

    @pytest.fixture
    def admin(self, server: ServerThread) -> Iterator[httpx.Client]:
        with httpx.Client(base_url=server.base_url) as client:
            yield client

    def test_missing_secret_is_401(self, admin: httpx.Client, fake_engine: FakeEngine) -> None:
        response = admin.post("/kv/reset")
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert fake_engine.num_prefix_cache_resets == 0

    def test_wrong_secret_is_401(self, admin: httpx.Client, fake_engine: FakeEngine) -> None:
        response = admin.post("/kv/reset", headers={"Authorization": "Bearer nope"})
        assert response.status_code == 401
        assert fake_engine.num_prefix_cache_resets == 0

    def test_right_secret_resets(self, admin: httpx.Client, fake_engine: FakeEngine) -> None:
        response = admin.post("/kv/reset", headers={"Authorization": "Bearer s3cret"})
        assert response.status_code == 200 and fake_engine.num_prefix_cache_resets == 1


def test_without_a_secret_remote_clients_cannot_reset() -> None:
    class Transport:
        def get_extra_info(self, name: str, default: object = None) -> object:
            return ("10.0.0.7", 5555) if name == "peername" else default

    class Context:
        settings = ReplicaServerSettings()

    request = make_mocked_request("POST", "/kv/reset", transport=Transport(),
                                  app={SERVING_KEY: Context()})  # type: ignore[dict-item]
    with pytest.raises(PermissionDeniedError):
        asyncio.run(kv_reset(request))
