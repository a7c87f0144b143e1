"""Building a tracer provider: the in-memory SpanBuffer always, OTLP/HTTP when configured.

One provider per app (never the global one), so several apps in one process (tests, `--workers`)
keep their spans apart. The provider is the lean one (infra/telemetry/lean_tracer.py: the
OpenTelemetry API, without the SDK's per-span validation and copies). Sampling is parent-based
over a trace-id ratio; spans that are not sampled cost a no-op span object. The OTLP exporter
sits behind the SDK's BatchSpanProcessor (its own thread), so exporting never blocks a request.
"""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource

from infra.telemetry.lean_tracer import LeanTracerProvider
from infra.telemetry.settings import TelemetrySettings
from infra.telemetry.span_buffer import SpanBuffer


def build_tracer_provider(settings: TelemetrySettings) -> tuple[LeanTracerProvider, SpanBuffer]:
    buffer = SpanBuffer(settings.num_traces_buffered, settings.num_spans_per_trace_max)
    provider = LeanTracerProvider(Resource.create({"service.name": settings.service_name}),
                                  sample_ratio=settings.sample_ratio,
                                  is_enabled=settings.is_tracing_enabled, processors=[buffer])
    if settings.is_tracing_enabled and settings.otlp_traces_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=settings.otlp_traces_endpoint)))
    return provider, buffer
