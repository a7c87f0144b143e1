"""The outermost middleware: a SERVER span per request (continuing an incoming `traceparent`),
made current with its `RequestObservation`, and the request metrics once the answer is done.

A streamed answer's handler can be cancelled (the client closed the connection right after the
last event) while the pipeline's shielded settle is still running; the span and the metrics then
wait for that settle (`observation.on_settled`), so they still carry the usage and the status the
client got.

Not traced (still counted): /metrics, /health, the dashboard and unknown paths, so scrapes,
polling and scanners do not crowd the trace buffer.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, StatusCode, format_trace_id

from gateway.telemetry.lean_tracer import attach_span, detach_span
from gateway.telemetry.observation import RequestObservation, reset_current, set_current
from gateway.telemetry.recent import LatencySample
from gateway.telemetry.upstream import PROPAGATOR

if TYPE_CHECKING:
    from gateway.telemetry.telemetry import Telemetry

TRACE_ID_HEADER = "x-aigw-trace-id"
STATUS_CLIENT_CLOSED = 499
_UNTRACED_PREFIXES = ("/metrics", "/health", "/dashboard")


def route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def make_middleware(telemetry: Telemetry) -> Middleware:
    """The traced middleware, or with tracing off one that creates no span objects at all (the
    observation still carries the usage record and first-line time the metrics need)."""
    tracer, metrics = telemetry.tracer, telemetry.metrics
    is_tracing = telemetry.settings.is_tracing_enabled

    @web.middleware
    async def telemetry_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = route_of(request)
        if route.startswith(_UNTRACED_PREFIXES) or route == "unmatched":
            untraced = await handler(request)
            metrics.requests_of(route, str(untraced.status), "", "").inc()
            return untraced
        span: Span | None = None
        context_token = None
        if is_tracing:
            span = tracer.start_span(f"{request.method} {route}", kind=SpanKind.SERVER,
                                     context=_incoming_context(request),
                                     attributes={"http.request.method": request.method,
                                                 "http.route": route})
            context_token = _attach(span)
        observation = RequestObservation(time.perf_counter(), span)
        token = set_current(observation)
        response: web.StreamResponse | None = None
        status = 500
        cancelled = False
        try:
            response = await handler(request)
            status = response.status
            if span is not None and not response.prepared:
                context = span.get_span_context()
                if context.trace_flags.sampled:
                    response.headers[TRACE_ID_HEADER] = format_trace_id(context.trace_id)
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status, cancelled = STATUS_CLIENT_CLOSED, True
            raise
        finally:
            if context_token is not None:
                _detach(context_token)
            reset_current(token)

            def finish() -> None:
                record = observation.record
                final = record.status if cancelled and record is not None else status
                _finish(telemetry, route, final, observation, response)

            if cancelled and observation.is_admitted and observation.record is None:
                observation.on_settled = finish  # the settle is still running: wait for it
            else:
                finish()
    return telemetry_middleware


def _incoming_context(request: web.Request) -> otel_context.Context | None:
    """The caller's trace context (W3C traceparent), or None (a new trace) without parsing."""
    if "traceparent" not in request.headers:
        return None
    return PROPAGATOR.extract(request.headers)


_attach = attach_span  # the span made current: what context.attach(set_span_in_context(span)) does
_detach = detach_span


def _finish(telemetry: Telemetry, route: str, status: int, observation: RequestObservation,
            response: web.StreamResponse | None) -> None:
    span = observation.span
    if span is not None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(StatusCode.ERROR)
        span.end()
    metrics = telemetry.metrics
    latency_s = time.perf_counter() - observation.started
    record = observation.record
    model, project = (record.model, record.project) if record is not None else ("", "")
    metrics.requests_of(route, str(status), model, project).inc()
    metrics.duration_of(route, model).observe(latency_s)
    overhead_s = None
    header = response.headers.get("x-aigw-overhead-ms") if response is not None else None
    if header:
        try:
            overhead_s = float(header) / 1000.0
            metrics.overhead_of(route).observe(overhead_s)
        except ValueError:
            pass
    ttft_s = None
    if record is not None and record.stream and observation.first_upstream_line_at is not None:
        ttft_s = observation.first_upstream_line_at - observation.started
        metrics.ttft_of(model).observe(ttft_s)
    if record is not None:
        telemetry.latency.add(LatencySample(time.time(), model, latency_s, overhead_s, ttft_s))
