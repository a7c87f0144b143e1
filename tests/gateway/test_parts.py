"""The gateway's small parts on their own: breaker, retry budget, router, settings, metrics
parsing, the backend registry, and the OpenAI-compatible backend over a MockTransport."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from gateway.backends import get_backend_class, register_backend
from gateway.backends.base import Backend
from gateway.backends.openai_compat import OpenAICompatBackend
from gateway.backends.replica import parse_load
from gateway.fleet.breaker import BreakerState, CircuitBreaker
from gateway.fleet.endpoints import Endpoint, EndpointLoad, Fleet
from gateway.request.canonical import (
    CanonicalRequest,
    Finish,
    Message,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from gateway.request.errors import UpstreamRejected, UpstreamThrottled, UpstreamUnavailable
from gateway.routing import LeastOutstandingRouter, create_router
from gateway.settings import GatewaySettings, ModelSettings, load_settings
from gateway.upstream.retry_budget import RetryBudget
from gateway.upstream.transport import MockResponse, MockTransport, UpstreamRequest


def test_breaker_opens_after_consecutive_failures_and_half_opens_for_one_trial() -> None:
    breaker = CircuitBreaker(num_failures_to_eject=2, ejection_s=10)
    breaker.record_failure(now=0)
    assert breaker.state is BreakerState.CLOSED and breaker.can_attempt(0)
    breaker.record_failure(now=1)
    assert breaker.state is BreakerState.OPEN and not breaker.can_attempt(5)
    assert breaker.can_attempt(11)
    breaker.on_attempt(11)
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.can_attempt(11)
    breaker.record_failure(now=12)
    assert breaker.state is BreakerState.OPEN and not breaker.can_attempt(21)
    breaker.on_attempt(22)
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.num_consecutive_failures == 0


def test_a_success_resets_the_consecutive_failure_count() -> None:
    breaker = CircuitBreaker(num_failures_to_eject=2, ejection_s=10)
    breaker.record_failure(0)
    breaker.record_success()
    breaker.record_failure(1)
    assert breaker.state is BreakerState.CLOSED


def test_retry_budget_allows_the_reserve_then_only_the_ratio() -> None:
    budget = RetryBudget(ratio=0.5, num_reserve=1)
    assert budget.try_withdraw() and not budget.try_withdraw()
    budget.on_request()
    assert not budget.try_withdraw()
    budget.on_request()
    assert budget.try_withdraw()


def _endpoints(num: int) -> list[Endpoint]:
    model = ModelSettings(name="m", endpoints=tuple(f"http://h{i}" for i in range(num)))
    return [Endpoint(url, model, CircuitBreaker(3, 10)) for url in model.endpoints]


def test_least_outstanding_router_prefers_idle_then_shorter_queue() -> None:
    endpoints = _endpoints(3)
    endpoints[0].num_outstanding = 2
    endpoints[2].load = EndpointLoad(num_requests_waiting=5)
    request = CanonicalRequest("r", "m")
    assert LeastOutstandingRouter().pick(request, endpoints).endpoint is endpoints[1]
    with pytest.raises(ValueError):
        create_router("nope")


def test_parse_load_reads_replica_gauges_and_skips_junk() -> None:
    text = ("# HELP x\naigw_replica_num_requests_running "
            "3\naigw_replica_num_requests_waiting{m=\"a\"} 2.0\n"
            "aigw_replica_kv_blocks_used 10\naigw_replica_kv_blocks_total 100\nbroken line here\n")
    assert parse_load(text) == EndpointLoad(3, 2, 10, 100)
    assert parse_load("nothing_useful 1\n") is None


def test_settings_come_from_a_toml_or_yaml_file_with_env_on_top(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "g.toml"
    toml.write_text('port = 9000\n[[models]]\nname = "a"\nendpoints = ["http://x:1/"]\n'
                    '[models.prices]\noutput_per_token = 2e-6\n')
    yaml = tmp_path / "g.yaml"
    yaml.write_text("port: 9001\nmodels:\n  - name: b\n    backend: openai\n    endpoints: "
                    "[http://y:2]\n")
    settings = load_settings(toml)
    assert settings.port == 9000 and settings.models[0].endpoints == ("http://x:1",)
    assert settings.models[0].prices.cost_usd(10, 4, 5) == pytest.approx(1e-5)
    monkeypatch.setenv("AIGW_PORT", "9100")
    assert load_settings(yaml).port == 9100 and load_settings(yaml).models[0].backend == "openai"
    with pytest.raises(ValueError):
        GatewaySettings(models=[{"name": "c", "endpoints": []}])


def test_backend_registry_knows_builtins_and_registered_plugins() -> None:
    assert get_backend_class("openai") is OpenAICompatBackend
    assert get_backend_class("replica").name == "replica"

    class Custom(OpenAICompatBackend):
        name = "custom"

    register_backend("custom", Custom)
    assert get_backend_class("custom") is Custom
    with pytest.raises(ValueError, match="aigw.backends"):
        get_backend_class("does-not-exist")
    assert issubclass(Custom, Backend)


def _fleet(transport: MockTransport, **model: object) -> Fleet:
    settings = GatewaySettings(auth_enabled=False, models=[{"name": "m", "backend": "openai",
                                                            "endpoints": ["http://up"], **model}])
    return Fleet(settings, transport)


def _collect(fleet: Fleet, request: CanonicalRequest) -> list[object]:
    route = fleet.get("m")
    assert route is not None

    async def run() -> list[object]:
        return [event async for event in route.backend.stream(request, route.endpoints[0])]

    return asyncio.run(run())


def _sse(*chunks: object) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_backend_parses_an_sse_stream_into_canonical_events() -> None:
    body = _sse({"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
                {"choices": [{"index": 0, "delta": {"tool_calls": [
                    {"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}]}}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
                {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                          "prompt_tokens_details": {"cached_tokens": 4}}})

    async def answer(request: UpstreamRequest) -> MockResponse:
        return MockResponse(200, body)

    transport = MockTransport(answer)
    request = CanonicalRequest("r1", "m", messages=[Message("user", "hi")], stream=True)
    events = _collect(_fleet(transport, upstream_model="real-name"), request)
    assert events == [TextDelta("Hel"), ToolCallDelta(0, "c1", "f", "{}"), Finish("tool_calls"),
                      Usage(7, 2, 4)]
    sent = orjson.loads(transport.requests[0].body or b"")
    assert sent["model"] == "real-name" and sent["stream_options"] == {"include_usage": True}
    assert transport.requests[0].headers["x-request-id"] == "r1"


def test_backend_counts_tokens_itself_when_the_upstream_sends_no_usage() -> None:
    async def answer(request: UpstreamRequest) -> MockResponse:
        return MockResponse(200, _sse({"choices": [{"index": 0, "delta": {"content": "12345678"},
                                                    "finish_reason": "stop"}]}))

    request = CanonicalRequest("r", "m", messages=[Message("user", "x" * 40)], stream=True)
    events = _collect(_fleet(MockTransport(answer)), request)
    assert events[-1] == Usage(prompt_tokens=10 + 4, completion_tokens=2)


def test_a_stream_cut_before_done_is_an_error_not_a_short_answer() -> None:
    async def answer(request: UpstreamRequest) -> MockResponse:
        return MockResponse(200, b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')

    with pytest.raises(UpstreamUnavailable, match="DONE"):
        _collect(_fleet(MockTransport(answer)), CanonicalRequest("r", "m", stream=True))


@pytest.mark.parametrize(("status", "error"), [(400, UpstreamRejected), (503, UpstreamUnavailable),
                                               (429, UpstreamThrottled)])
def test_upstream_status_maps_to_retryable_or_not(status: int, error: type[Exception]) -> None:
    async def answer(request: UpstreamRequest) -> MockResponse:
        return MockResponse(status, b'{"error": "no"}')

    with pytest.raises(error) as caught:
        _collect(_fleet(MockTransport(answer)), CanonicalRequest("r", "m"))
    assert caught.value.retryable is (status != 400)  # type: ignore[attr-defined]
