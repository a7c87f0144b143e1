"""Telemetry parts without a replica: the span buffer's bounds, traceparent injection on the
upstream call, usage series and percentiles, settings from the environment, and the replica's
after-the-fact spans from engine timings."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from contracts.sampling_params import SamplingParams
from engine.outputs import RequestOutput
from engine.server.tracing import TracedEngine
from gateway.metering.contract import UsageRecord
from gateway.request.observer import NULL_OBSERVER
from gateway.telemetry.middleware import PROPAGATOR
from gateway.telemetry.observers import RequestTracing
from gateway.telemetry.recent import LatencySample, LatencyWindow, UsageSeries
from gateway.telemetry.request_trace import RequestTrace, RouteStep
from gateway.telemetry.telemetry import Telemetry
from gateway.upstream.transport import MockResponse, MockTransport, UpstreamRequest, send_observed
from infra.telemetry.attributes import exception_attributes
from infra.telemetry.lean_tracer import new_span_context
from infra.telemetry.settings import TelemetrySettings
from infra.telemetry.tracing import build_tracer_provider


def _record(project: str = "p", prompt: int = 100, cached: int = 40,
            at: float = 1000.0) -> UsageRecord:
    return UsageRecord(request_id="r", project=project, key_id="k", model="m", endpoint="e",
                       prompt_tokens=prompt, cached_tokens=cached, completion_tokens=10,
                       cost_usd=0.5, latency_ms=12.0, status=200, created_at=at)


def test_span_buffer_keeps_only_the_most_recent_traces_and_caps_spans_per_trace() -> None:
    provider, buffer = build_tracer_provider(TelemetrySettings(num_traces_buffered=2,
                                                               num_spans_per_trace_max=3))
    tracer = provider.get_tracer("t")
    trace_ids = []
    for _ in range(3):
        with tracer.start_as_current_span("root") as root:
            for index in range(5):
                tracer.start_span(f"child{index}").end()
        trace_ids.append(format(root.get_span_context().trace_id, "032x"))
    assert buffer.trace(trace_ids[0]) == []  # evicted
    assert len(buffer.trace(trace_ids[2])) == 3
    assert [t[0]["trace_id"] for t in buffer.recent(5)] == [trace_ids[2], trace_ids[1]]
    assert buffer.trace("not-hex") == []


def test_tracing_off_records_nothing() -> None:
    provider, buffer = build_tracer_provider(TelemetrySettings(is_tracing_enabled=False))
    with provider.get_tracer("t").start_as_current_span("root"):
        pass
    assert buffer.recent() == []


def _request_trace(telemetry: Telemetry, traceparent: str | None = None) -> RequestTrace:
    parent = None
    if traceparent is not None:
        parent = trace_api.get_current_span(
            PROPAGATOR.extract({"traceparent": traceparent})).get_span_context()
    return RequestTrace(new_span_context(parent, telemetry.provider.bound), parent, "POST",
                        "/v1/chat/completions", telemetry.origin, time.time_ns())


def test_request_traces_keep_the_newest_and_requests_of_one_callers_trace_stay_together() -> None:
    telemetry = Telemetry(TelemetrySettings(num_traces_buffered=3))
    own = [_request_trace(telemetry) for _ in range(5)]
    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    shared = [_request_trace(telemetry, caller) for _ in range(2)]
    for trace in own[:4]:
        trace.status_code, trace.end_ns = 200, trace.start_ns + 1
        telemetry.export(trace)
    assert [t[0]["trace_id"] for t in telemetry.spans.recent(10)] == [
        t.trace_id_hex for t in own[3:0:-1]]  # read: the oldest of the four already dropped
    for trace in (shared[0], own[4], shared[1]):
        trace.status_code, trace.end_ns = 200, trace.start_ns + 1
        telemetry.export(trace)
    recent = telemetry.spans.recent(10)
    assert [t[0]["trace_id"] for t in recent] == [shared[0].trace_id_hex, own[4].trace_id_hex,
                                                   own[3].trace_id_hex]
    assert [s["span_id"] for s in recent[0] if s["kind"] == "SERVER"] == [
        f"{t.context.span_id:016x}" for t in shared]  # both requests of the caller's trace
    assert telemetry.spans.trace(own[0].trace_id_hex) == []


def test_upstream_call_carries_the_traceparent_of_its_client_span() -> None:
    """The backend's call as a traced request's observer sees it: the CLIENT span's id goes
    upstream in `traceparent`, the status and the first token are noted, the call ends."""
    telemetry = Telemetry(TelemetrySettings())

    async def answer(_: UpstreamRequest) -> MockResponse:
        return MockResponse(200, b"data: 1\n\ndata: [DONE]\n")

    mock = MockTransport(answer)
    trace = _request_trace(telemetry)
    observer = RequestTracing(telemetry, 0.0, trace)

    async def call() -> None:
        upstream = UpstreamRequest("POST", "http://10.0.0.5:8001/v1/x")
        observed = observer.on_upstream_call(upstream)
        response = await send_observed(mock, upstream, observed)
        lines = [line async for batch in response.line_batches() for line in batch]
        observer.on_first_token()
        response.close()
        assert observed is not None
        observed.on_ended()
        assert lines and observer.first_token_at is not None

    asyncio.run(call())
    trace.end_ns = time.time_ns()
    telemetry.export(trace)
    trace_id = format(trace.context.trace_id, "032x")
    spans = {s["name"]: s for s in telemetry.spans.trace(trace_id)}
    upstream = spans["upstream POST /v1/x"]
    assert upstream["attributes"]["aigw.replica"] == "10.0.0.5:8001"
    assert upstream["attributes"]["http.response.status_code"] == 200
    (call,) = trace.calls
    assert call.first_line_ns is not None and call.end_ns is not None
    assert upstream["parent_span_id"] == spans["POST /v1/chat/completions"]["span_id"]
    traceparent = mock.requests[0].headers["traceparent"]
    version, sent_trace_id, parent_id, flags = traceparent.split("-")
    assert (version, sent_trace_id, parent_id) == ("00", trace_id, upstream["span_id"])
    assert int(flags, 16) & 1  # sampled


def test_calls_outside_a_request_are_not_traced_or_changed() -> None:
    telemetry = Telemetry(TelemetrySettings())

    async def answer(_: UpstreamRequest) -> MockResponse:
        return MockResponse(200, b"ok")

    mock = MockTransport(answer)
    upstream = UpstreamRequest("GET", "http://h:1/health")
    asyncio.run(send_observed(mock, upstream, NULL_OBSERVER.on_upstream_call(upstream)))
    assert "traceparent" not in mock.requests[0].headers and telemetry.spans.recent() == []


def test_a_request_trace_builds_its_spans_when_read_under_the_callers_span() -> None:
    """Two routing decisions and two upstream calls (a retry after a refused connection): every
    span is a child of the SERVER span, which continues the caller's traceparent; the failed call
    carries the exception; an exporter gets the same SDK spans the buffer shows."""
    exported = InMemorySpanExporter()
    telemetry = Telemetry(TelemetrySettings())
    telemetry.provider.add_span_processor(SimpleSpanProcessor(exported))
    caller_trace_id, caller_span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    trace = _request_trace(telemetry, f"00-{caller_trace_id}-{caller_span_id}-01")
    trace.auth_start_ns, trace.auth_end_ns = trace.start_ns + 10, trace.start_ns + 20
    trace.auth_identity = ("proj", "key1", "api_key")
    trace.request = ("chat", "m", "req-1", True, 16, 0.5, None, None)
    model = SimpleNamespace(name="m")
    endpoints = [SimpleNamespace(name="r0", model=model), SimpleNamespace(name="r1", model=model)]
    for index, endpoint in enumerate(endpoints):
        decision = SimpleNamespace(endpoint=endpoint, reason="least_outstanding")
        trace.add_route(RouteStep(trace.start_ns + 30, trace.start_ns + 40, "least_outstanding",
                                  decision, endpoints[index:], None))
    failed = trace.new_call("upstream POST /v1/chat/completions", {"url.full": "u0"},
                            trace.start_ns + 50)
    failed.end_ns, failed.exception = (trace.start_ns + 60,
                                       exception_attributes(ConnectionRefusedError("no")))
    served = trace.new_call("upstream POST /v1/chat/completions", {"url.full": "u1"},
                            trace.start_ns + 70)
    served.status_code, served.first_line_ns, served.end_ns = (200, trace.start_ns + 80,
                                                               trace.start_ns + 90)
    trace.record = _record("proj")
    trace.status_code, trace.end_ns = 200, trace.start_ns + 100
    telemetry.export(trace)

    spans = telemetry.spans.trace(caller_trace_id)
    root = spans[0]
    assert (root["name"], root["kind"], root["parent_span_id"]) == (
        "POST /v1/chat/completions", "SERVER", caller_span_id)
    assert root["attributes"]["gen_ai.request.model"] == "m"
    assert root["attributes"]["gen_ai.request.temperature"] == 0.5
    assert "gen_ai.request.top_p" not in root["attributes"]
    assert root["attributes"]["gen_ai.usage.input_tokens"] == 100
    assert root["attributes"]["aigw.project"] == "proj"
    assert root["attributes"]["http.response.status_code"] == 200
    children = spans[1:]
    assert [s["name"] for s in children] == ["gateway.auth", "gateway.route", "gateway.route",
                                             "upstream POST /v1/chat/completions",
                                             "upstream POST /v1/chat/completions"]
    assert {s["parent_span_id"] for s in children} == {root["span_id"]}
    assert children[0]["attributes"]["aigw.auth.via"] == "api_key"
    assert children[1]["attributes"]["aigw.routing.candidates"] == ["r0", "r1"]
    assert children[1]["attributes"]["aigw.routing.model"] == "m"
    assert children[2]["attributes"]["aigw.routing.candidates"] == ["r1"]
    assert children[3]["status"] == "ERROR" and children[4]["status"] == "UNSET"
    assert [s["span_id"] for s in children[3:]] == [f"{c.span_id:016x}" for c in (failed, served)]
    assert children[4]["attributes"]["http.response.status_code"] == 200
    built = trace.spans()
    assert [e.name for e in built[4].events] == ["exception"]
    assert [e.name for e in built[5].events] == ["first_line"]
    assert list(exported.get_finished_spans()) == built  # the exporter got the same spans


def test_usage_series_buckets_per_project_with_cache_savings() -> None:
    series = UsageSeries(bucket_s=10, num_buckets=6)
    series.add(_record("a", at=1000.0), cache_savings_per_token=0.01)
    series.add(_record("a", at=1005.0), cache_savings_per_token=0.01)
    series.add(_record("b", at=1012.0), cache_savings_per_token=0.0)
    data = series.to_json(now=1015.0, num_buckets=3)
    assert data["t"] == [990, 1000, 1010]
    a = data["projects"]["a"]  # type: ignore[index]
    assert a["series"]["requests"] == [0, 2, 0]
    assert a["totals"]["cached_tokens"] == 80 and a["totals"]["savings_usd"] == pytest.approx(0.8)
    series.add(_record("a", at=1100.0), cache_savings_per_token=0.0)  # older buckets fall out
    assert series.to_json(now=1100.0, num_buckets=20)["projects"]["a"]["totals"]["requests"] == 1  # type: ignore[index]


def test_latency_percentiles_cover_only_the_window() -> None:
    window = LatencyWindow()
    for index in range(100):
        window.add(LatencySample(1000.0, "m", latency_s=index / 100, overhead_s=0.001, ttft_s=None))
    window.add(LatencySample(100.0, "m", latency_s=99.0, overhead_s=None, ttft_s=None))  # too old
    result = window.percentiles(window_s=60, now=1010.0)
    assert result["num_requests"] == 100
    assert result["latency_s"] == {"p50": 0.5, "p90": 0.89, "p99": 0.98}
    assert result["ttft_s"] == {"p50": None, "p90": None, "p99": None}


def test_settings_read_otel_endpoint_and_switches() -> None:
    settings = TelemetrySettings.from_env(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/",
                                                   "AIGW_TRACE_SAMPLE_RATIO": "0.25"})
    assert settings.otlp_traces_endpoint == "http://c:4318/v1/traces"
    assert settings.sample_ratio == 0.25 and settings.is_tracing_enabled
    assert not TelemetrySettings.from_env(environ={"OTEL_SDK_DISABLED": "true"}).is_tracing_enabled
    assert not TelemetrySettings.from_env(environ={"AIGW_TRACING": "off"}).is_tracing_enabled
    with pytest.raises(ValueError):
        TelemetrySettings(sample_ratio=2.0)


class _Engine:
    replica_id = "r1"

    class model_config:  # noqa: N801 - shaped like ModelConfig
        model_id = "tiny"


def test_replica_spans_are_built_back_from_engine_timings_under_the_incoming_parent() -> None:
    provider, buffer = build_tracer_provider(TelemetrySettings(service_name="aigw-replica"))
    engine = TracedEngine(_Engine(), provider.get_tracer("t"))  # type: ignore[arg-type]
    final = RequestOutput("req", [1], "x", finish_reason="length", num_prompt_tokens=40,
                          num_cached_tokens=32, num_output_tokens=5,
                          timings={"queue_s": 0.5, "prefill_s": 0.25, "decode_s": 1.0})
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    finished_ns = 10_000_000_000
    engine.record("req", SamplingParams(max_tokens=5), final,
                  {"traceparent": f"00-{trace_id}-{parent_id}-01"}, finished_ns - 2_000_000_000,
                  finished_ns)
    spans = {s["name"]: s for s in buffer.trace(trace_id)}
    assert spans["replica.generate"]["parent_span_id"] == parent_id
    assert spans["engine.decode"]["start_ns"] == finished_ns - 1_000_000_000
    assert spans["engine.prefill"]["start_ns"] == finished_ns - 1_250_000_000
    assert spans["engine.queue"]["start_ns"] == finished_ns - 1_750_000_000
    assert spans["engine.prefill"]["attributes"]["aigw.cached_tokens"] == 32
    assert spans["replica.generate"]["attributes"]["gen_ai.usage.output_tokens"] == 5


class _FailingEngine(_Engine):
    def generate(self, request_id: str, *args: object, **kwargs: object):  # noqa: ANN201
        async def outputs():  # noqa: ANN202
            yield RequestOutput(request_id, [1], "x", num_prompt_tokens=7, num_output_tokens=1)
            raise RuntimeError("the engine loop died")
        return outputs()


def test_a_replica_request_the_engine_fails_leaves_an_error_span() -> None:
    provider, buffer = build_tracer_provider(TelemetrySettings(service_name="aigw-replica"))
    engine = TracedEngine(_FailingEngine(), provider.get_tracer("t"))  # type: ignore[arg-type]
    trace_id = "0af7651916cd43dd8448eb211c80319d"

    async def consume() -> None:
        async for _ in engine.generate("req", [1, 2], SamplingParams(max_tokens=5),
                                       trace_headers={"traceparent": f"00-{trace_id}-"
                                                                     "b7ad6b7169203331-01"}):
            pass

    with pytest.raises(RuntimeError):
        asyncio.run(consume())
    spans = {s["name"]: s for s in buffer.trace(trace_id)}
    root = spans["replica.generate"]
    assert root["status"] == "ERROR" and root["attributes"]["error.type"] == "RuntimeError"
    assert root["attributes"]["gen_ai.usage.input_tokens"] == 7
    assert "gen_ai.response.finish_reasons" not in root["attributes"]
    assert spans["engine.decode"]["parent_span_id"] == root["span_id"]


def test_the_trace_list_names_the_model_of_a_request_refused_before_routing() -> None:
    from gateway.dashboard.views import trace_summary

    root = {"trace_id": "t", "span_id": "a", "parent_span_id": None,
            "name": "POST /v1/chat/completions",
            "start_ns": 0, "end_ns": 1_000_000, "status": "ERROR",
            "attributes": {"http.response.status_code": 503, "gen_ai.response.model": "dead",
                           "aigw.project": "p", "aigw.replica": ""}}
    summary = trace_summary([root])
    assert summary is not None
    assert (summary["model"], summary["replica"], summary["http_status"]) == ("dead", None, 503)


def test_an_exceptions_span_attributes_are_bounded_however_long_its_message() -> None:
    """Trace buffers keep spans by count: an error quoting a whole request must not make one
    span megabytes."""
    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        raise ValueError("x" * 1_000_000)

    try:
        deep(200)
    except ValueError as exc:
        values = exception_attributes(exc)
    assert values["exception.type"] == "ValueError"
    assert 1024 <= len(values["exception.message"]) <= 1030
    assert len(values["exception.stacktrace"]) <= 4096 + 40
    stacktrace = values["exception.stacktrace"]
    assert "in deep" in stacktrace and stacktrace.endswith("ValueError: " + "x" * 1024 + "...\n")
