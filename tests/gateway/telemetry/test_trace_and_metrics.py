"""One request through the gateway to a real replica is one trace: gateway, auth, routing decision,
upstream call, and the replica's queue/prefill/decode, with GenAI attributes matching the usage
the client got. /metrics carries the names and labels operators alert on."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.served_replica import ADMIN_KEY, PROJECT, USER_KEY, Served

pytestmark = pytest.mark.slow
TIMEOUT_S = 120.0


def _chat(served: Served, content: str, **extra: object) -> httpx.Response:
    body = {"model": served.model, "max_tokens": 6, "temperature": 0.0,
            "messages": [{"role": "user", "content": content}], **extra}
    response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S,
                          headers={"authorization": f"Bearer {USER_KEY}"})
    assert response.status_code == 200, response.text
    return response


def _trace(served: Served, trace_id: str) -> list[dict]:
    response = httpx.get(f"{served.url}/dashboard/api/traces/{trace_id}", timeout=TIMEOUT_S,
                         headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200, response.text
    return response.json()["spans"]


def test_one_request_is_one_trace_across_gateway_and_replica(served: Served) -> None:
    response = _chat(served, "Name a colour.")
    usage = response.json()["usage"]
    trace_id = response.headers["x-aigw-trace-id"]
    spans = _trace(served, trace_id)
    by_name = {span["name"]: span for span in spans}
    assert {s["trace_id"] for s in spans} == {trace_id}
    expected = {"POST /v1/chat/completions", "gateway.auth", "gateway.route",
                "upstream POST /v1/chat/completions", "replica.generate", "engine.queue",
                "engine.prefill", "engine.decode"}
    assert expected <= set(by_name), sorted(by_name)

    root = by_name["POST /v1/chat/completions"]
    upstream = by_name["upstream POST /v1/chat/completions"]
    generate = by_name["replica.generate"]
    assert root["parent_span_id"] is None
    assert by_name["gateway.auth"]["parent_span_id"] == root["span_id"]
    assert by_name["gateway.route"]["parent_span_id"] == root["span_id"]
    assert upstream["parent_span_id"] == root["span_id"]
    assert generate["parent_span_id"] == upstream["span_id"]  # continued via traceparent
    for child in ("engine.queue", "engine.prefill", "engine.decode"):
        assert by_name[child]["parent_span_id"] == generate["span_id"]
        assert by_name[child]["service"] == "aigw-replica"
    assert by_name["engine.queue"]["end_ns"] <= by_name["engine.prefill"]["start_ns"] + 1
    assert by_name["engine.prefill"]["end_ns"] <= by_name["engine.decode"]["start_ns"] + 1

    attrs = root["attributes"]
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == served.model
    assert attrs["gen_ai.response.model"] == served.model
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert (attrs["gen_ai.response.finish_reasons"]
            == [response.json()["choices"][0]["finish_reason"]])
    assert attrs["aigw.project"] == PROJECT and attrs["aigw.key_id"] == "key-acme"
    assert attrs["aigw.replica"] == served.replica_url.split("://")[1]
    assert attrs["aigw.cost_usd"] > 0
    assert "aigw.cached_tokens" in attrs
    assert generate["attributes"]["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert generate["attributes"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert by_name["engine.prefill"]["attributes"]["aigw.cached_tokens"] == \
        generate["attributes"]["aigw.cached_tokens"]
    route = by_name["gateway.route"]["attributes"]
    assert route["aigw.replica"] == attrs["aigw.replica"]
    assert route["aigw.routing.candidates"] and route["aigw.routing.policy"]


def _samples(text: str) -> dict[str, list[dict[str, str]]]:
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    return samples


def test_metrics_carry_requests_tokens_cache_routing_and_health(served: Served) -> None:
    _chat(served, "Say yes.")
    _chat(served, "Say no.", stream=True, stream_options={"include_usage": True})
    # Per-project series are for operators: an admin credential (or the metrics token) sees them,
    # an anonymous scrape gets every series summed over projects.
    anonymous = _samples(httpx.get(served.url + "/metrics", timeout=TIMEOUT_S).text)
    assert not any("project" in labels for labels in anonymous["aigw_requests_total"])
    samples = _samples(httpx.get(served.url + "/metrics", timeout=TIMEOUT_S,
                                 headers={"authorization": f"Bearer {ADMIN_KEY}"}).text)

    def labels_of(name: str) -> list[dict[str, str]]:
        assert name in samples, f"{name} missing from /metrics"
        return samples[name]

    requests = labels_of("aigw_requests_total")
    assert {"route": "/v1/chat/completions", "status": "200", "model": served.model,
            "project": PROJECT} in requests
    for name in ("aigw_request_duration_seconds_bucket", "aigw_time_to_first_token_seconds_bucket"):
        assert any(labels.get("model") == served.model for labels in labels_of(name))
    assert any(labels.get("route") == "/v1/chat/completions"
               for labels in labels_of("aigw_overhead_seconds_bucket"))
    for name in ("aigw_input_tokens_total", "aigw_cached_tokens_total", "aigw_output_tokens_total",
                 "aigw_cost_usd_total"):
        assert {"model": served.model, "project": PROJECT} in labels_of(name)
    assert {"project": PROJECT} in labels_of("aigw_prompt_cache_hit_ratio")
    replica = served.replica_url.split("://")[1]
    assert any(labels["replica"] == replica and labels["policy"]
               for labels in labels_of("aigw_routing_decisions_total"))
    assert {"model": served.model, "endpoint": replica} in labels_of("aigw_endpoint_healthy")


def test_dashboard_api_needs_an_admin_key(served: Served) -> None:
    url = served.url + "/dashboard/api/overview"
    assert httpx.get(url, timeout=TIMEOUT_S).status_code == 401
    user = httpx.get(url, headers={"authorization": f"Bearer {USER_KEY}"}, timeout=TIMEOUT_S)
    assert user.status_code == 403
    admin = httpx.get(url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=TIMEOUT_S)
    assert admin.status_code == 200
    assert admin.json()["replicas"][0]["name"] == served.replica_url.split("://")[1]
    assert admin.json()["tracing"] == {"enabled": True, "sample_ratio": 1.0, "max_new_per_s": 100.0,
                                       "num_traces_buffered": 200}
