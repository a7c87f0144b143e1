"""An upstream's 429 reaches the client as a 429 with the upstream's Retry-After and
x-ratelimit-* headers (once no other endpoint is left to try), in every dialect's envelope; a
throttled endpoint is tried again elsewhere first and is not counted a breaker failure."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL, CannedUpstreamFactory, GatewayFactory, Refusal

THROTTLE = {"retry-after": "17", "x-ratelimit-limit-requests": "60",
            "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "17s"}
THROTTLED = Refusal(429, {"error": {"message": "Rate limit reached for org-secret-123",
                                    "type": "requests", "code": "rate_limit_exceeded"}}, THROTTLE)


def _gateway(make_gateway: GatewayFactory, urls: list[str]) -> Any:
    return make_gateway(num_upstreams=0, configs=[], num_retries=2, num_failures_to_eject=1,
                        models=[{"name": MODEL, "backend": "openai", "endpoints": urls}])


def test_an_upstream_429_reaches_every_dialect_as_a_429_with_its_headers(
        make_gateway: GatewayFactory, canned_upstreams: CannedUpstreamFactory) -> None:
    (first, first_calls), (second, second_calls) = (canned_upstreams(THROTTLED) for _ in range(2))
    gateway = _gateway(make_gateway, [first, second])
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=MODEL, stream=stream,
                                           messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 429
        assert {k: caught.value.response.headers[k] for k in THROTTLE} == THROTTLE
        assert caught.value.code == "rate_limit_exceeded"
        assert "org-secret" not in caught.value.response.text  # the upstream's account
    assert len(first_calls) == len(second_calls) == 2  # each endpoint tried once a request
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude.messages.create(model=MODEL, max_tokens=5,
                               messages=[{"role": "user", "content": "hi"}])
    assert refused.value.response.headers["retry-after"] == "17"
    assert refused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    responses = httpx.post(gateway.url + "/v1/responses", json={"model": MODEL, "input": "hi"})
    assert responses.status_code == 429 and responses.headers["retry-after"] == "17"
    assert responses.json()["error"]["code"] == "rate_limit_exceeded"
    # throttled is not broken: the breakers (threshold 1) stayed closed, so no 503
    health = httpx.get(gateway.url + "/health").json()
    assert health["status"] == "ok", health


def test_a_throttled_endpoint_is_retried_on_another_before_the_429(
        make_gateway: GatewayFactory, canned_upstreams: CannedUpstreamFactory) -> None:
    (throttled, throttled_calls) = canned_upstreams(THROTTLED)
    (serving, serving_calls) = canned_upstreams(None)
    gateway = _gateway(make_gateway, [throttled, serving])
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    for _ in range(4):
        answer = client.chat.completions.create(model=MODEL,
                                                messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content == "fine"
    assert len(serving_calls) == 4 and len(throttled_calls) >= 1
