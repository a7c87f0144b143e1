"""The outermost middleware: a `RequestTrace` per sampled request (its SERVER span continues an
incoming `traceparent`), in the `RequestObservation` it makes current, and the request metrics
once the answer is done; the finished trace goes to the span buffer and any exporter.

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
from opentelemetry import trace as trace_api
from opentelemetry.trace import SpanContext, TraceFlags

from gateway.telemetry.lean_tracer import new_span_context, new_span_id, new_trace_id
from gateway.telemetry.observation import RequestObservation, reset_current, set_current
from gateway.telemetry.recent import LatencySample
from gateway.telemetry.request_trace import RequestTrace, TraceOrigin
from gateway.telemetry.upstream import PROPAGATOR

if TYPE_CHECKING:
    from gateway.telemetry.telemetry import Telemetry

TRACE_ID_HEADER = "x-aigw-trace-id"
STATUS_CLIENT_CLOSED = 499
_UNTRACED_PREFIXES = ("/metrics", "/health", "/dashboard")
_SAMPLED = TraceFlags.SAMPLED


def route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def make_middleware(telemetry: Telemetry) -> Middleware:
    """The traced middleware; with tracing off (or a request not sampled) it makes no trace (the
    observation still carries the usage record and first-line time the metrics need)."""
    metrics = telemetry.metrics
    is_tracing = telemetry.settings.is_tracing_enabled
    sample_bound, origin = telemetry.provider.bound, telemetry.origin

    @web.middleware
    async def telemetry_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = route_of(request)
        if route.startswith(_UNTRACED_PREFIXES) or route == "unmatched":
            untraced = await handler(request)
            task = asyncio.current_task()
            if isinstance(untraced, web.FileResponse) and task is not None:
                # a file's status (304, 404) is settled when aiohttp sends it, after this returns
                # (in this task: aiohttp handles and sends each request in one)
                task.add_done_callback(lambda _: metrics.requests_of(
                    route, str(untraced.status), "", "").inc())
            else:
                metrics.requests_of(route, str(untraced.status), "", "").inc()
            return untraced
        trace = _start_trace(request, route, sample_bound, origin) if is_tracing else None
        observation = RequestObservation(time.perf_counter(), trace)
        if trace is None and is_tracing:
            observation.unsampled_traceparent = _unsampled_traceparent(request)
        token = set_current(observation)
        response: web.StreamResponse | None = None
        status = 500
        cancelled = False
        try:
            response = await handler(request)
            status = response.status
            if trace is not None and not response.prepared:
                response.headers[TRACE_ID_HEADER] = trace.trace_id_hex
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status, cancelled = STATUS_CLIENT_CLOSED, True
            raise
        finally:
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


def _start_trace(request: web.Request, route: str, sample_bound: int, origin: TraceOrigin
                 ) -> RequestTrace | None:
    """The request's trace if it is sampled: a child of the caller's sampled `traceparent`, or a
    new trace kept at the configured ratio."""
    parent = _incoming_span(request)
    context = new_span_context(parent, sample_bound)
    if not context[3] & _SAMPLED:  # (SpanContext is a tuple: its trace flags fourth)
        return None
    return RequestTrace(context, parent, request.method, route, origin, time.time_ns())


def _unsampled_traceparent(request: web.Request) -> str:
    """The not-sampled decision, passed on (W3C: the caller's trace id, if any, and flags 00)."""
    parent = _incoming_span(request)
    trace_id = parent.trace_id if parent is not None else new_trace_id()
    return f"00-{trace_id:032x}-{new_span_id():016x}-00"


def _incoming_span(request: web.Request) -> SpanContext | None:
    """The caller's span (W3C traceparent), or None (a new trace) without parsing."""
    if "traceparent" not in request.headers:
        return None
    parent = trace_api.get_current_span(PROPAGATOR.extract(request.headers)).get_span_context()
    return parent if parent.is_valid else None


def _finish(telemetry: Telemetry, route: str, status: int, observation: RequestObservation,
            response: web.StreamResponse | None) -> None:
    trace = observation.trace
    if trace is not None:
        trace.status_code = status
        trace.end_ns = time.time_ns()
        telemetry.export(trace)
    metrics = telemetry.metrics
    latency_s = time.perf_counter() - observation.started
    record = observation.record
    model, project = ((record.model, record.project) if record is not None
                      else (observation.model, observation.project))
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
