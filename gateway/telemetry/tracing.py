"""Building a TracerProvider: the in-memory SpanBuffer always, OTLP/HTTP when configured.

One provider per app (never the global one), so several apps in one process (tests, `--workers`)
keep their spans apart. Sampling is parent-based over a trace-id ratio; spans that are not
sampled cost a no-op span object. The OTLP exporter sits behind a BatchSpanProcessor (its
own thread), so exporting never blocks a request.
"""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

from gateway.telemetry.settings import TelemetrySettings
from gateway.telemetry.span_buffer import SpanBuffer


def build_tracer_provider(settings: TelemetrySettings) -> tuple[TracerProvider, SpanBuffer]:
    buffer = SpanBuffer(settings.num_traces_buffered, settings.num_spans_per_trace_max)
    root_sampler = TraceIdRatioBased(settings.sample_ratio) if settings.is_tracing_enabled else ALWAYS_OFF
    sampler = ParentBased(root_sampler) if settings.is_tracing_enabled else ALWAYS_OFF
    provider = TracerProvider(sampler=sampler,
                              resource=Resource.create({"service.name": settings.service_name}))
    provider.add_span_processor(buffer)
    if settings.is_tracing_enabled and settings.otlp_traces_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=settings.otlp_traces_endpoint)))
    return provider, buffer
