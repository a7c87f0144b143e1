"""Upstream failures: retry before the first token, a proper error event after it, never a hang."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from bench.mock_upstream import MockConfig
from tests.gateway.conftest import MODEL, GatewayFactory, wait_until

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}




@pytest.mark.parametrize("stream", [False, True])
def test_failure_before_first_token_is_retried_on_the_other_endpoint(make_gateway: GatewayFactory,
                                                                      stream: bool) -> None:
    gateway = make_gateway(configs=[MockConfig(fail_mode="before_first_byte"), MockConfig()])
    healthy = gateway.upstreams[1].url.split("://")[1]
    for _ in range(3):
        response = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status_code == 200
        assert response.headers["x-aigw-replica"] == healthy
        assert response.text.count("tok ") == 8
    assert len(gateway.upstreams[0].state.request_ids) >= 1  # it was tried, and then ejected
    assert wait_until(lambda: len(gateway.meter.settled) == 3)
    assert gateway.meter.num_settle_calls == 3  # one per client request, retries included


def test_all_endpoints_failing_gives_502_in_the_envelope(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(fail_mode="before_first_byte")] * 2)
    response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unavailable"
    assert response.headers["x-request-id"]


def test_mid_stream_failure_ends_openai_stream_with_error_chunk(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(fail_mode="mid_stream", fail_after_tokens=2)])
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    received = []
    with pytest.raises(openai.APIError, match="upstream"):
        for chunk in client.chat.completions.create(**CHAT, stream=True):
            received += [c.delta.content for c in chunk.choices if c.delta.content]
    assert "".join(received) == "tok " * 2  # what arrived together may come as one chunk
    assert wait_until(lambda: gateway.meter.num_settle_calls == 1)
    record = next(iter(gateway.meter.settled.values()))
    assert record.status == 200 and record.finish_reason == "error"


def test_mid_stream_failure_ends_anthropic_stream_with_error_event(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(fail_mode="mid_stream", fail_after_tokens=1)])
    response = httpx.post(gateway.url + "/anthropic/v1/messages", json={**CHAT, "max_tokens": 50,
                                                                        "stream": True})
    assert response.status_code == 200
    assert "event: error" in response.text and "message_stop" not in response.text
    client = anthropic.Anthropic(base_url=gateway.url + "/anthropic", api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIStatusError):
        with client.messages.stream(**CHAT, max_tokens=50) as stream:
            list(stream.text_stream)


def test_hanging_upstream_times_out_with_504(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(fail_mode="hang")], first_token_timeout_s=0.5,
                           response_timeout_s=0.5)
    started = time.monotonic()
    response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 504 and response.json()["error"]["code"] == "upstream_timeout"
    assert time.monotonic() - started < 5
    anthropic_response = httpx.post(gateway.url + "/v1/messages", json={**CHAT, "max_tokens": 5},
                                    timeout=10)
    assert anthropic_response.status_code == 504
    assert anthropic_response.json()["type"] == "error"


def test_stalled_stream_ends_with_timeout_error_event(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(token_delay_ms=3000, num_tokens=3)],
                           idle_timeout_s=0.5)
    response = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=10)
    assert '"code":"upstream_timeout"' in response.text and "[DONE]" not in response.text


def test_client_disconnect_cancels_the_upstream_request(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(token_delay_ms=100, num_tokens=100)])
    with httpx.stream("POST", gateway.url + "/v1/chat/completions",
                      json={**CHAT, "stream": True}, timeout=10) as response:
        request_id = response.headers["x-request-id"]
        next(response.iter_lines())
    state = gateway.upstreams[0].state
    assert wait_until(lambda: request_id in state.disconnected_ids)
    assert wait_until(lambda: request_id in gateway.meter.settled)
    assert gateway.meter.settled[request_id].status == 499


def test_no_healthy_endpoint_gives_503(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(health_status=503)])
    assert wait_until(lambda: httpx.get(gateway.url + "/health").json()["models"][MODEL][
        "num_healthy_endpoints"] == 0)
    response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_healthy_endpoint"
    anthropic_response = httpx.post(gateway.url + "/v1/messages", json={**CHAT, "max_tokens": 5})
    assert anthropic_response.json()["error"]["type"] == "overloaded_error"


def test_endpoint_recovers_after_health_returns(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(health_status=503)])
    state = gateway.upstreams[0].state
    assert wait_until(lambda: httpx.post(gateway.url + "/v1/chat/completions",
                                         json=CHAT).status_code == 503)
    state.config.health_status = 200
    assert wait_until(lambda: httpx.post(gateway.url + "/v1/chat/completions",
                                         json=CHAT).status_code == 200)


@pytest.mark.parametrize("cause", ["client_disconnect", "upstream_failure"])
def test_a_stream_that_ends_without_usage_bills_the_prompt_the_replica_processed(
        make_gateway: GatewayFactory, cause: str) -> None:
    """No usage chunk arrived, yet the replica read the whole prompt (chat template included):
    the record counts it as count_tokens does, not with the ~4-characters estimate."""
    config = (MockConfig(token_delay_ms=100, num_tokens=100) if cause == "client_disconnect"
              else MockConfig(fail_mode="mid_stream", fail_after_tokens=2))
    gateway = make_gateway(configs=[config])
    expected = httpx.post(gateway.url + "/v1/messages/count_tokens",
                          json=CHAT).json()["input_tokens"]
    with httpx.stream("POST", gateway.url + "/v1/chat/completions",
                      json={**CHAT, "stream": True}, timeout=10) as response:
        request_id = response.headers["x-request-id"]
        if cause == "client_disconnect":
            next(response.iter_lines())
        else:
            response.read()
    assert wait_until(lambda: request_id in gateway.meter.settled)
    record = gateway.meter.settled[request_id]
    assert record.status == (499 if cause == "client_disconnect" else 200)
    assert record.prompt_tokens == expected > 5  # "hi" alone would be estimated at 5


def test_a_non_streamed_request_whose_client_left_bills_the_prompt_its_upstream_was_given(
        make_gateway: GatewayFactory) -> None:
    """The client gave up while the upstream computed its whole answer (no event had come: a
    non-streamed answer is one body): the upstream read the prompt, so the 499 record bills it as
    count_tokens counts it (it billed 0 tokens, however long the upstream had worked)."""
    gateway = make_gateway(configs=[MockConfig(latency_ms=3000)])
    expected = httpx.post(gateway.url + "/v1/messages/count_tokens",
                          json=CHAT).json()["input_tokens"]
    num_settle_calls = gateway.meter.num_settle_calls
    with pytest.raises(httpx.TimeoutException):
        httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=0.5)
    state = gateway.upstreams[0].state
    assert wait_until(lambda: len(state.disconnected_ids) == 1)
    request_id = state.disconnected_ids[0]
    assert wait_until(lambda: request_id in gateway.meter.settled)
    record = gateway.meter.settled[request_id]
    assert record.status == 499 and record.completion_tokens == 0
    assert record.prompt_tokens == expected > 5
    assert record.endpoint == gateway.upstreams[0].url.split("://")[1]
    assert gateway.meter.num_settle_calls == num_settle_calls + 1


def test_a_slow_non_streamed_answer_waits_for_the_response_timeout_not_the_first_token_one(
        make_gateway: GatewayFactory) -> None:
    """A non-streamed answer's first event is the whole body: it may take as long as generating
    every token (minutes on a CPU), so `first_token_timeout_s` does not bound it."""
    gateway = make_gateway(configs=[MockConfig(latency_ms=1500)], first_token_timeout_s=0.5,
                           response_timeout_s=30)
    response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 200, response.text
    streamed = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=10)
    assert streamed.status_code == 504 and "no first token within 0.5s" in streamed.text
