"""Errors as clients see them: an upstream's OpenAI error passes through with its code and param,
names the replica that answered and keeps the rate-limit headers; 502s leak no internals."""

from __future__ import annotations

import time
from typing import Any

import httpx
from aiohttp import web

from bench.mock_upstream import MockConfig
from tests.gateway.conftest import MODEL, GatewayFactory, LoopThread, chat_upstream_app, start_app
from tests.gateway.test_auth_seam import KeyAuthenticator, RecordingMeter

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
TOO_LONG = {"error": {"message": "This model's maximum context length is 16 tokens.",
                      "type": "invalid_request_error", "param": "messages",
                      "code": "context_length_exceeded"}}


def _refusing_upstream(loop_thread: LoopThread) -> tuple[web.AppRunner, str]:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response(TOO_LONG, status=400)

    app = chat_upstream_app(refuse)
    app.router.add_post("/v1/completions", refuse)
    return loop_thread.run(start_app(app))


def _gateway_on(make_gateway: GatewayFactory, url: str, **overrides: Any) -> Any:
    return make_gateway(num_upstreams=0, configs=[], models=[
        {"name": MODEL, "backend": "replica", "endpoints": [url]}], **overrides)


def test_upstream_context_length_error_reaches_client_unchanged_with_the_replica_named(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    runner, url = _refusing_upstream(loop_thread)
    try:
        meter = RecordingMeter()
        gateway = _gateway_on(make_gateway, url, authenticator=KeyAuthenticator(), meter=meter)
        headers = {"authorization": "Bearer good"}
        response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 400
        assert response.json() == TOO_LONG
        assert "x-aigw-replica" not in response.headers  # host:port: for operators only
        assert meter.settled[-1].endpoint == url.split("://")[1]  # the ledger names it
        assert response.headers["x-ratelimit-remaining-requests"] == "9"
        operator = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT,
                              headers={"authorization": "Bearer admin"})
        assert operator.status_code == 400
        assert operator.headers["x-aigw-replica"] == url.split("://")[1]
        anthropic = httpx.post(gateway.url + "/v1/messages", json={**CHAT, "max_tokens": 5},
                               headers=headers)
        assert anthropic.status_code == 400
        assert anthropic.json()["error"]["type"] == "invalid_request_error"
        assert anthropic.json()["error"]["message"] == TOO_LONG["error"]["message"]
        responses = httpx.post(gateway.url + "/v1/responses", json={"model": MODEL, "input": "hi"},
                               headers=headers)
        assert responses.status_code == 400
        assert responses.json()["error"]["code"] == "context_length_exceeded"
        assert responses.json()["error"]["param"] == "input"  # Responses has no `messages`
    finally:
        loop_thread.run(runner.cleanup())


def test_invalid_parameter_is_named_in_the_openai_error_param(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway()
    response = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "temperature": 5})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temperature"


def test_unreachable_upstream_answers_502_without_its_url_or_an_exception_repr(
        make_gateway: GatewayFactory) -> None:
    # No health check before the request (the fixture's 0.2 s interval would mark the endpoint
    # down first on a slow machine: a 503 no_healthy_endpoint, not the dispatch this tests).
    gateway = _gateway_on(make_gateway, "http://127.0.0.1:9", num_retries=0, health_interval_s=600)
    response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert message.startswith("upstream failed")
    assert "127.0.0.1" not in message and "Error(" not in message


def test_openai_prefixed_completions_route_serves_completions(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway()
    response = httpx.post(gateway.url + "/openai/v1/completions",
                          json={"model": MODEL, "prompt": "hi"})
    assert response.status_code == 200
    assert response.json()["object"] == "text_completion"


def test_malformed_body_without_a_credential_is_401_not_400(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(authenticator=KeyAuthenticator(), meter=RecordingMeter())
    response = httpx.post(gateway.url + "/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 401


def test_non_bearer_authorization_falls_back_to_x_api_key_as_on_admin_routes(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(authenticator=KeyAuthenticator(), meter=RecordingMeter())
    response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT,
                          headers={"authorization": "Basic Zm9vOmJhcg==", "x-api-key": "good"})
    assert response.status_code == 200


def test_health_says_degraded_while_a_model_has_no_healthy_endpoint(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(health_status=503)])
    deadline = time.monotonic() + 10
    health = httpx.get(gateway.url + "/health")
    while health.json()["status"] != "degraded" and time.monotonic() < deadline:
        time.sleep(0.05)
        health = httpx.get(gateway.url + "/health")
    assert health.status_code == 200
    assert health.json()["status"] == "degraded"
    assert health.json()["models"][MODEL]["num_healthy_endpoints"] == 0


def test_health_is_ok_when_every_model_can_serve(gateway: Any) -> None:
    health = httpx.get(gateway.url + "/health")
    assert (health.status_code, health.json()["status"]) == (200, "ok")
