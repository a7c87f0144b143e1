"""Telemetry: one per gateway app; owns the tracer provider, the span buffer, the metrics and the
dashboard's in-memory series. Its middleware gives each request an observer
(gateway/telemetry/observers.py) that the pipeline tells what happens (gateway/request/observer.py).

    telemetry = Telemetry(TelemetrySettings.from_env())      # create_app does this by default
    app = create_app(settings, telemetry=telemetry)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from gateway.fleet.endpoints import Fleet
from gateway.metering.contract import UsageRecord
from gateway.settings import GatewaySettings
from gateway.telemetry.access_log import AccessLog
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.middleware import make_middleware
from gateway.telemetry.observers import RequestMetrics
from gateway.telemetry.recent import LatencyWindow, UsageSeries
from gateway.telemetry.request_trace import RequestTrace, TraceOrigin
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
        self.routing_policy = ""  # aigw_routing_decisions_total's `policy` (the router's name)

    def attach(self, settings: GatewaySettings, fleet: Fleet) -> None:
        """Bind to the app's settings (prices, the router's name) and fleet (endpoint gauges);
        once per app."""
        self.routing_policy = settings.router
        self._savings_by_model = {
            model.name: max(0.0, model.prices.input_per_token - model.prices.cached_input_per_token)
            for model in settings.models}
        self.metrics.attach_fleet(fleet)
        self.metrics.project_label.max_projects = settings.metrics_max_projects

    def background_observer(self) -> RequestMetrics:
        """The observer of requests made outside HTTP (batch lines): counted, never traced."""
        return RequestMetrics(self, 0.0)

    def export(self, trace: RequestTrace) -> None:
        """A finished request's trace: kept raw in the span buffer (spans built when read); an
        exporter (OTLP) gets its spans now, built here, and sends them from its own thread."""
        self.spans.add(trace)
        for processor in self.provider.processors:
            if processor is not self.spans:
                for span in trace.spans():
                    processor.on_end(span)

    def observe_usage(self, record: UsageRecord) -> None:
        """A settled usage record: the token and cost counters, the dashboard's usage series."""
        self.metrics.observe_usage(record)
        self.usage.add(record, self._savings_by_model.get(record.model, 0.0),
                       self.metrics.project_label[record.project])  # (bounded: as the labels)

    def install(self, app: web.Application) -> None:
        """app[TELEMETRY] and a clean shutdown of the exporters."""
        from gateway.telemetry.keys import TELEMETRY

        app[TELEMETRY] = self
        app.cleanup_ctx.append(self._lifecycle)

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(self.provider.shutdown)
