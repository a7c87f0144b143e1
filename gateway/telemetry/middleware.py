"""The outermost middleware: a SERVER span per request (continuing an incoming `traceparent`),
made current with its `RequestObservation`, and the request metrics once the answer is done.

Not traced (still counted): /metrics, /health and the dashboard, so scrapes and polling do not
crowd the trace buffer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from opentelemetry.trace import SpanKind, StatusCode, format_trace_id

from gateway.telemetry.observation import RequestObservation, reset_current, set_current
from gateway.telemetry.recent import LatencySample
from gateway.telemetry.upstream import PROPAGATOR

if TYPE_CHECKING:
    from gateway.telemetry.telemetry import Telemetry

TRACE_ID_HEADER = "x-aigw-trace-id"
_UNTRACED_PREFIXES = ("/metrics", "/health", "/dashboard")


def route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def make_middleware(telemetry: Telemetry) -> Middleware:
    tracer, metrics = telemetry.tracer, telemetry.metrics

    @web.middleware
    async def telemetry_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = route_of(request)
        if route.startswith(_UNTRACED_PREFIXES):
            response = await handler(request)
            metrics.requests.labels(route, str(response.status), "", "").inc()
            return response
        started = time.perf_counter()
        status = 500
        with tracer.start_as_current_span(
                f"{request.method} {route}", kind=SpanKind.SERVER,
                context=PROPAGATOR.extract(request.headers), record_exception=False,
                attributes={"http.request.method": request.method, "http.route": route}) as span:
            observation = RequestObservation(started, span)
            token = set_current(observation)
            response: web.StreamResponse | None = None
            try:
                response = await handler(request)
                status = response.status
                context = span.get_span_context()
                if not response.prepared and context.trace_flags.sampled:
                    response.headers[TRACE_ID_HEADER] = format_trace_id(context.trace_id)
                return response
            except web.HTTPException as exc:
                status = exc.status
                raise
            except BaseException:
                status = 499 if request.transport is None or request.transport.is_closing() else 500
                raise
            finally:
                reset_current(token)
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(StatusCode.ERROR)
                _observe(telemetry, route, status, observation, response)
    return telemetry_middleware


def _observe(telemetry: Telemetry, route: str, status: int, observation: RequestObservation,
             response: web.StreamResponse | None) -> None:
    metrics = telemetry.metrics
    latency_s = time.perf_counter() - observation.started
    record = observation.record
    model, project = (record.model, record.project) if record is not None else ("", "")
    metrics.requests.labels(route, str(status), model, project).inc()
    metrics.duration.labels(route, model).observe(latency_s)
    overhead_s = None
    header = response.headers.get("x-aigw-overhead-ms") if response is not None else None
    if header:
        try:
            overhead_s = float(header) / 1000.0
            metrics.overhead.labels(route).observe(overhead_s)
        except ValueError:
            pass
    ttft_s = None
    if record is not None and record.stream and observation.first_upstream_line_at is not None:
        ttft_s = observation.first_upstream_line_at - observation.started
        metrics.ttft.labels(model).observe(ttft_s)
    if record is not None:
        telemetry.latency.add(LatencySample(time.time(), model, latency_s, overhead_s, ttft_s))
