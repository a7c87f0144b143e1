"""Telemetry: one per gateway app; owns the tracer provider, the span buffer, the metrics and the
dashboard's in-memory series, and hands out the observing wrappers app.py builds the Pipeline with.

    telemetry = Telemetry(TelemetrySettings.from_env())      # create_app does this by default
    app = create_app(settings, telemetry=telemetry)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from auth.principal import Authenticator
from gateway.fleet.endpoints import Fleet
from gateway.metering.contract import Meter, UsageRecord
from gateway.request.canonical import CanonicalRequest
from gateway.request.errors import GatewayError
from gateway.routing.base import Router
from gateway.settings import GatewaySettings
from gateway.telemetry.access_log import AccessLog
from gateway.telemetry.hooks import (
    CountedRouter,
    ObservedMeter,
    TracedAuthenticator,
    TracedRouter,
)
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.middleware import TRACE_ID_HEADER, make_middleware
from gateway.telemetry.observation import current_observation
from gateway.telemetry.recent import LatencyWindow, UsageSeries
from gateway.telemetry.request_trace import FallbackStep, RequestTrace, TraceOrigin
from gateway.telemetry.upstream import TracingTransport
from gateway.upstream.transport import Transport
from infra.telemetry.settings import TelemetrySettings
from infra.telemetry.tracing import build_tracer_provider


class Telemetry:
    def __init__(self, settings: TelemetrySettings | None = None) -> None:
        self.settings = settings or TelemetrySettings.from_env()
        self.provider, self.spans = build_tracer_provider(self.settings)
        self.origin = TraceOrigin(self.provider.resource, InstrumentationScope("aigw.gateway"))
        self.metrics = GatewayMetrics()
        self.usage = UsageSeries()
        self.latency = LatencyWindow()
        self.access_log = (AccessLog(self.settings.access_log)
                           if self.settings.access_log != "off" else None)
        self.middleware = make_middleware(self)
        self._savings_by_model: dict[str, float] = {}  # USD saved per cached prompt token

    def attach(self, settings: GatewaySettings, fleet: Fleet) -> None:
        """Bind to the app's settings (prices) and fleet (endpoint gauges); once per app."""
        self._savings_by_model = {
            model.name: max(0.0, model.prices.input_per_token - model.prices.cached_input_per_token)
            for model in settings.models}
        self.metrics.attach_fleet(fleet)
        self.metrics.project_label.max_projects = settings.metrics_max_projects

    # With tracing off (settings.is_tracing_enabled false) the wrappers below do no trace work:
    # the choice is made here, once, not per request.
    def traced_transport(self, transport: Transport) -> Transport:
        return TracingTransport(transport)

    def traced_router(self, router: Router, policy: str) -> Router:
        if not self.settings.is_tracing_enabled:
            return CountedRouter(router, self.metrics, policy)
        return TracedRouter(router, self.metrics, policy)

    def traced_authenticator(self, authenticator: Authenticator) -> Authenticator:
        if not self.settings.is_tracing_enabled:
            return authenticator
        return TracedAuthenticator(authenticator)

    def export(self, trace: RequestTrace) -> None:
        """A finished request's trace: kept raw in the span buffer (spans built when read); an
        exporter (OTLP) gets its spans now, built here, and sends them from its own thread."""
        self.spans.add(trace)
        for processor in self.provider.processors:
            if processor is not self.spans:
                for span in trace.spans():
                    processor.on_end(span)

    def observed_meter(self, meter: Meter) -> Meter:
        return ObservedMeter(meter, self.on_record)

    def on_record(self, record: UsageRecord) -> None:
        observation = current_observation()
        if observation is not None:
            observation.record = record
            if observation.trace is not None:
                observation.trace.record = record
        self.metrics.observe_usage(record)
        self.usage.add(record, self._savings_by_model.get(record.model, 0.0))
        if observation is not None and observation.on_settled is not None:
            observation.on_settled()

    def on_fallback(self, request: CanonicalRequest, from_model: str, to_model: str, reason: str,
                    error: GatewayError) -> None:
        """A hop down a fallback chain (gateway/request/fallback.py): counted in
        aigw_fallbacks_total, noted in the request's trace (a `gateway.fallback` span)."""
        self.metrics.fallbacks_of(from_model, to_model, reason).inc()
        observation = current_observation()
        if observation is not None and observation.trace is not None:
            observation.trace.add_fallback(FallbackStep(time.time_ns(), from_model, to_model,
                                                        reason, error.code))

    def on_cache_turn(self, turn: Any) -> None:
        """A session's turn explained (gateway/request/cache_explainer.py): into the trace."""
        observation = current_observation()
        if observation is not None and observation.trace is not None:
            observation.trace.cache_turn = turn

    def response_stamp(self) -> Callable[[web.StreamResponse], None] | None:
        """What the pipeline calls on each answer it sends itself (the trace id header; the
        middleware stamps the answers it is handed back unsent); None with tracing off."""
        return _stamp_trace_id if self.settings.is_tracing_enabled else None

    def install(self, app: web.Application) -> None:
        """app[TELEMETRY] and a clean shutdown of the exporters."""
        from gateway.telemetry.keys import TELEMETRY

        app[TELEMETRY] = self
        app.cleanup_ctx.append(self._lifecycle)

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(self.provider.shutdown)


def _stamp_trace_id(response: web.StreamResponse) -> None:
    observation = current_observation()
    trace = observation.trace if observation is not None else None
    if trace is not None:
        response.headers[TRACE_ID_HEADER] = trace.trace_id_hex
