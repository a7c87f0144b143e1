"""`aigw serve`'s wiring (gateway.web.services) of settings it used to drop: per-key limits and the
prompt-cache salt scope reach the real meter and auth, on real sockets."""

from __future__ import annotations

from pathlib import Path

import httpx

from bench.mock_upstream import MockState, create_mock_app
from gateway.settings import GatewaySettings
from gateway.web.services import create_served_app, metering_settings
from tests.gateway.conftest import MODEL, LoopThread, start_app

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def test_every_limit_setting_reaches_the_meter_settings() -> None:
    settings = GatewaySettings(limits={"requests_per_minute": 10},
                               key_limits={"tokens_per_minute": 500},
                               project_limits={"p": {"daily_budget_usd": 2.5}},
                               key_limits_by_id={"k1": {"requests_per_minute": 1}})
    metering = metering_settings(settings)
    assert metering.default_project_limits.requests_per_minute == 10
    assert metering.default_key_limits.tokens_per_minute == 500
    assert metering.project_limits["p"].daily_budget_usd == 2.5
    assert metering.key_limits["k1"].requests_per_minute == 1


def test_served_app_applies_key_limits_and_per_key_cache_salt(
        loop_thread: LoopThread, tmp_path: Path) -> None:
    state = MockState()
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(state)))
    settings = GatewaySettings(
        data_dir=tmp_path, key_limits={"requests_per_minute": 1}, cache_salt_scope="key",
        models=[{"name": MODEL, "backend": "replica", "endpoints": [upstream_url]}])
    app = loop_thread.run(create_served_app(settings))
    runner, url = loop_thread.run(start_app(app))
    try:
        key = (tmp_path / "default-key.txt").read_text().strip()
        headers = {"authorization": f"Bearer {key}"}
        first = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
        assert first.status_code == 200, first.text
        assert state.bodies[-1]["cache_salt"].startswith("key:default:")
        second = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
        assert second.status_code == 429
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())


def test_an_echo_scoring_request_reserves_no_completion_tokens(
        loop_thread: LoopThread, tmp_path: Path) -> None:
    """max_tokens 0 with echo scores the prompt only: the reservation is the prompt alone (it
    reserved default_max_tokens, 1024 a choice, so that concurrent scoring requests of an
    evaluation harness were refused long before the tokens-per-minute limit)."""
    state = MockState()
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(state)))
    settings = GatewaySettings(
        data_dir=tmp_path, limits={"tokens_per_minute": 100_000},
        models=[{"name": MODEL, "backend": "replica", "endpoints": [upstream_url]}])
    app = loop_thread.run(create_served_app(settings))
    runner, url = loop_thread.run(start_app(app))
    try:
        key = (tmp_path / "default-key.txt").read_text().strip()
        body = {"model": MODEL, "prompt": "abcd" * 10, "max_tokens": 0, "echo": True, "n": 2}
        response = httpx.post(url + "/v1/completions", json=body,
                              headers={"authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        # the prompt as the replica counts it (admission renders it exactly under a token
        # limit), and no completion tokens
        from engine.loader import default_model_path
        from gateway.routing.prompt_hashing import shared_prompt_hasher

        num_prompt = len(shared_prompt_hasher(str(default_model_path()), 1 << 20).token_ids(
            {"model": MODEL, "prompt": body["prompt"]}))
        assert response.headers["x-ratelimit-remaining-tokens"] == str(100_000 - num_prompt)
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())
