"""A replica's admission refusal (429, code latency_target, Retry-After: the contract of
engine/server) is tried on the next-best replica once, then reaches the client as a 429 in its
dialect with the replica's Retry-After; each request settles once, a refused one with no tokens,
and the refusals are counted in aigw_latency_refusals_total. (Against real replicas with a tiny
target: tests/gateway/test_slo_replica_e2e.py.)"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.gateway.conftest import (
    MODEL,
    CannedUpstreamFactory,
    GatewayFactory,
    Refusal,
    wait_until,
)

REFUSAL = Refusal(429, {"error": {
    "message": "predicted queueing 2400 ms would break the TTFT target 500 ms",
    "type": "server_overloaded", "code": "latency_target", "param": None}},
    {"retry-after": "3", "x-aigw-predicted-queue-ms": "2400"})


def _gateway(make_gateway: GatewayFactory, urls: list[str]) -> Any:
    return make_gateway(num_upstreams=0, configs=[], num_retries=2, num_failures_to_eject=1,
                        router="least_outstanding",
                        models=[{"name": MODEL, "backend": "replica", "endpoints": urls,
                                 "ttft_p90_ms": 500}])


def _refusals(gateway: Any) -> dict[str, float]:
    text = httpx.get(gateway.url + "/metrics").text
    counts = {}
    for line in text.splitlines():
        if line.startswith("aigw_latency_refusals_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = float(line.rsplit(" ", 1)[1])
    return counts


def test_a_refusal_is_tried_on_the_next_replica_and_settled_once(
        make_gateway: GatewayFactory, canned_upstreams: CannedUpstreamFactory) -> None:
    (refusing, refused_calls) = canned_upstreams(REFUSAL)
    (serving, served_calls) = canned_upstreams(None)
    gateway = _gateway(make_gateway, [refusing, serving])
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    for _ in range(3):
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], service_tier="flex")
        assert answer.choices[0].message.content == "fine"
    assert len(served_calls) == 3 and len(refused_calls) >= 1
    assert wait_until(lambda: gateway.meter.num_settle_calls == 3)
    assert sorted(r.completion_tokens for r in gateway.meter.settled.values()) == [1, 1, 1]
    counts = _refusals(gateway)
    assert counts.get("retried") == len(refused_calls) and "passed_on" not in counts
    # a refusal is not an outage: the breaker (threshold 1) stayed closed
    assert httpx.get(gateway.url + "/health").json()["status"] == "ok"


def test_when_every_replica_refuses_each_dialect_gets_a_429_with_retry_after(
        make_gateway: GatewayFactory, canned_upstreams: CannedUpstreamFactory) -> None:
    made = [canned_upstreams(REFUSAL) for _ in range(3)]
    gateway = _gateway(make_gateway, [url for url, _ in made])
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=MODEL, stream=stream,
                                           messages=[{"role": "user", "content": "hi"}])
        assert caught.value.response.headers["retry-after"] == "3"
        assert caught.value.code == "latency_target"
        assert caught.value.body["type"] == "rate_limit_error"  # type: ignore[index]
        assert "x-aigw-predicted-queue-ms" not in caught.value.response.headers
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude.messages.create(model=MODEL, max_tokens=5,
                               messages=[{"role": "user", "content": "hi"}])
    assert refused.value.response.headers["retry-after"] == "3"
    assert refused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    # two replicas at most per request (the chosen one and the next best), of three
    assert sum(len(calls) for _, calls in made) == 3 * 2
    assert wait_until(lambda: gateway.meter.num_settle_calls == 3)
    records = list(gateway.meter.settled.values())
    assert [(r.status, r.prompt_tokens, r.completion_tokens, r.cost_usd) for r in records] == [
        (429, 0, 0, 0.0)] * 3
    assert _refusals(gateway) == {"retried": 3.0, "passed_on": 3.0}
