"""Limits and budgets set through the admin API on a served gateway (embedded store, real sockets,
the mock upstream): in force from the next request, per project and per key, refused with the
dialect's 429; bad bodies are a 400; a cross-site write is a 403; DELETE brings the config back;
a soft threshold POSTs a signed webhook once per window to a local aiohttp receiver."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web

from auth import AuthSettings
from bench.mock_upstream import MockState, create_mock_app
from gateway.metering.alerts import SIGNATURE_HEADER, verify_signature
from gateway.settings import GatewaySettings
from gateway.web.services import create_served_app
from tests.auth._admin_key import make_admin_key
from tests.gateway.conftest import MODEL, LoopThread, start_app

PRICES = {"input_per_token": 0.001, "output_per_token": 0.001}  # 1 cent per 10 tokens
WEBHOOK_SECRET = "a-webhook-secret-of-some-length"


@dataclass
class Served:
    url: str
    admin: dict[str, str]  # an operator's key (ai_gateway:admin)
    state: MockState
    hooks: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    hook_url: str = ""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, loop_thread: LoopThread) -> Iterator[Served]:
    tmp_path = tmp_path_factory.mktemp("runtime-limits")
    state = MockState()
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(state)))
    hooks: list[tuple[dict[str, str], bytes]] = []

    async def receive(request: web.Request) -> web.Response:
        hooks.append((dict(request.headers), await request.read()))
        return web.Response(status=204)

    receiver = web.Application()
    receiver.router.add_post("/hook", receive)
    hook_runner, hook_url = loop_thread.run(start_app(receiver))
    settings = GatewaySettings(
        data_dir=tmp_path, models=[{"name": MODEL, "backend": "replica",
                                    "endpoints": [upstream_url], "prices": PRICES}])
    runner, url = loop_thread.run(start_app(loop_thread.run(create_served_app(settings))))
    key = loop_thread.run(make_admin_key(AuthSettings(data_dir=tmp_path, enabled=False)))
    try:
        yield Served(url, {"authorization": f"Bearer {key}"}, state, hooks, hook_url + "/hook")
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.run(hook_runner.cleanup())
        loop_thread.run(upstream.cleanup())


def _project(served: Served, name: str) -> str:
    response = httpx.post(served.url + "/admin/v1/projects", json={"name": name},
                          headers=served.admin)
    assert response.status_code == 201, response.text
    key = httpx.post(served.url + f"/admin/v1/projects/{name}/keys", headers=served.admin,
                     json={"scopes": ["ai_gateway:invoke"]})
    assert key.status_code == 201, key.text
    return str(key.json()["key"])


def _chat(served: Served, key: str, max_tokens: int = 5, **extra: Any) -> httpx.Response:
    return httpx.post(served.url + "/v1/chat/completions",
                      headers={"authorization": f"Bearer {key}"},
                      json={"model": MODEL, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": "hi"}], **extra}, timeout=30)


def test_a_project_rpm_set_through_the_api_holds_from_the_next_request(served: Served) -> None:
    key = _project(served, "rpm")
    assert _chat(served, key).status_code == 200
    put = httpx.put(served.url + "/admin/v1/projects/rpm/limits", headers=served.admin,
                    json={"requests_per_minute": 2})
    assert put.status_code == 200, put.text
    assert put.json()["source"] == "api" and put.json()["effective"]["requests_per_minute"] == 2
    statuses = [_chat(served, key).status_code for _ in range(3)]
    assert statuses[0] == 200  # the first request of this minute was counted before the limit
    assert 429 in statuses
    refused = next(r for r in (_chat(served, key),) if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "retry-after" in refused.headers
    deleted = httpx.delete(served.url + "/admin/v1/projects/rpm/limits", headers=served.admin)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert deleted.json()["source"] == "config"
    assert _chat(served, key).status_code == 200  # the config has no limit


def test_a_key_budget_refuses_within_one_request_and_names_the_window(served: Served) -> None:
    key = _project(served, "budget")
    listed = httpx.get(served.url + "/admin/v1/projects/budget/keys", headers=served.admin).json()
    key_id = listed["data"][0]["key_id"]
    put = httpx.put(served.url + f"/admin/v1/keys/{key_id}/limits", headers=served.admin,
                    json={"budgets": [{"usd": 0.05, "window": "month"}]})
    assert put.status_code == 200, put.text
    spent, statuses = 0.0, []
    for _ in range(12):
        response = _chat(served, key, max_tokens=4)
        statuses.append(response.status_code)
        if response.status_code != 200:
            break
        usage = response.json()["usage"]
        spent += 0.001 * (usage["prompt_tokens"] + usage["completion_tokens"])
    assert statuses[-1] == 429, statuses
    assert "monthly budget of this key is spent" in response.json()["error"]["message"]
    last = 0.001 * (usage["prompt_tokens"] + usage["completion_tokens"])
    assert spent <= 0.05 + last + 1e-9  # passed by at most the one request in flight
    got = httpx.get(served.url + f"/admin/v1/keys/{key_id}/limits", headers=served.admin).json()
    assert got["effective"]["budgets"][0]["window"] == "month"


def test_concurrent_requests_over_the_limit_are_refused(served: Served,
                                                        loop_thread: LoopThread) -> None:
    key = _project(served, "conc")
    assert httpx.put(served.url + "/admin/v1/projects/conc/limits", headers=served.admin,
                     json={"max_concurrent_requests": 2}).status_code == 200
    served.state.config.latency_ms = 400.0  # each request holds its slot that long

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            responses = await asyncio.gather(*(client.post(
                served.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                json={"model": MODEL, "max_tokens": 64, "stream": True,
                      "messages": [{"role": "user", "content": "hi"}]}) for _ in range(6)))
        return [r.status_code for r in responses]

    try:
        statuses = loop_thread.run(burst())
    finally:
        served.state.config.latency_ms = 0.0
    assert statuses.count(200) >= 2 and 429 in statuses, statuses
    assert _chat(served, key).status_code == 200  # every slot came back


def test_bad_limits_are_a_400_and_a_cross_site_write_a_403(served: Served) -> None:
    _project(served, "bad")
    url = served.url + "/admin/v1/projects/bad/limits"
    for body in ({"requests_per_minute": 0}, {"budgets": [{"usd": 1, "window": "custom"}]},
                 {"budgets": [{"usd": 1, "alert_at": [1.5]}]}, {"webhook_url": "http://x/"},
                 {"daily_budget_usd": 1, "budgets": [{"usd": 2, "window": "day"}]},
                 {"surprise": 1}, [1, 2],
                 # no coercion: true is not 1 request a minute, "10" not a number
                 {"requests_per_minute": True}, {"requests_per_minute": "10"},
                 {"daily_budget_usd": "5"}, {"budgets": [{"usd": True}]},
                 {"budgets": [{"usd": 5, "alert_at": [True]}]}):
        response = httpx.put(url, headers=served.admin, json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["code"] in ("invalid_limits", "invalid_request")
    response = httpx.put(url, headers=served.admin, content=b"{not json")
    assert response.status_code == 400
    forged = httpx.put(url, json={"requests_per_minute": 1},
                       headers={**served.admin, "origin": "https://evil.example",
                                "sec-fetch-site": "cross-site"})
    assert forged.status_code == 403 and forged.json()["error"]["code"] == "cross_site_request"
    assert httpx.get(url, headers=served.admin).json()["source"] == "config"
    assert httpx.put(served.url + "/admin/v1/projects/nope/limits", headers=served.admin,
                     json={}).status_code == 404
    assert httpx.put(url, json={}).status_code == 401


def test_a_soft_threshold_fires_one_signed_webhook_per_window(served: Served) -> None:
    key = _project(served, "alerts")
    put = httpx.put(served.url + "/admin/v1/projects/alerts/limits", headers=served.admin, json={
        "budgets": [{"usd": 10.0, "window": "custom", "window_s": 3600,
                     "alert_at": [0.001, 0.002]}],
        "webhook_url": served.hook_url, "webhook_secret": WEBHOOK_SECRET})
    assert put.status_code == 200, put.text
    assert put.json()["stored"]["webhook_secret_set"] is True
    assert "webhook_secret" not in put.json()["stored"]
    for _ in range(6):  # ~0.02 USD: both thresholds (0.01, 0.02 USD) reached, each once
        assert _chat(served, key, max_tokens=16).status_code == 200
    deadline = time.monotonic() + 5
    while len(served.hooks) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # nothing more comes
    bodies = [json.loads(body) for _, body in served.hooks]
    assert sorted(b["threshold"] for b in bodies) == [0.001, 0.002], bodies
    for headers, body in served.hooks:
        signed = {k.lower(): v for k, v in headers.items()}[SIGNATURE_HEADER]
        assert verify_signature(WEBHOOK_SECRET, signed, body)
        assert not verify_signature("another-secret-of-some-length", signed, body)
        assert not verify_signature(WEBHOOK_SECRET, signed, body + b" ")
    assert {b["project"] for b in bodies} == {"alerts"}
    assert all(b["spent_usd"] >= b["threshold"] * 10.0 for b in bodies)
