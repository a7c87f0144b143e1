"""The outermost middleware: the request's observer (gateway/telemetry/observers.py:
`RequestTracing` with a `RequestTrace` for a sampled request, whose SERVER span continues an
incoming `traceparent`, else `RequestMetrics`), put on the request for the pipeline
(`request[OBSERVER_KEY]`, gateway/request/observer.py), and the request metrics once the answer
is done; the finished trace goes to the span buffer and any exporter.

A streamed answer's handler can be cancelled (the client closed the connection right after the
last event) while the pipeline's shielded settle is still running; the span and the metrics then
wait for that settle (`observer.on_done`), so they still carry the usage and the status the
client got.

Not traced (still counted): /metrics, /health, the dashboard and unknown paths, so scrapes,
polling and scanners do not crowd the trace buffer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from opentelemetry import trace as trace_api
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.request.answer import OVERHEAD_MS
from gateway.request.observer import OBSERVER_KEY, TRACE_ID_HEADER
from gateway.telemetry.observers import TRACE_FLAGS_HEX, RequestMetrics, RequestTracing
from gateway.telemetry.recent import LatencySample
from gateway.telemetry.request_trace import RequestTrace, TraceOrigin
from gateway.telemetry.sampling import TraceRateLimit
from infra.telemetry.lean_tracer import new_span_context

if TYPE_CHECKING:
    from gateway.telemetry.access_log import AccessLog
    from gateway.telemetry.telemetry import Telemetry

__all__ = ["TRACE_ID_HEADER", "make_middleware"]
PROPAGATOR: TextMapPropagator = TraceContextTextMapPropagator()
STATUS_CLIENT_CLOSED = 499
_UNTRACED_PREFIXES = ("/metrics", "/health", "/dashboard")
_SAMPLED = TraceFlags.SAMPLED

# A new request over the trace rate limit still tells the upstream not to record it, under ids
# of its own (trace id: this process's random 64 bits, then a count; span id: the count) made
# from a counter rather than drawn, as the request will never be traced: unique, cheap, flags 00.
_UNSAMPLED_PREFIX = f"00-{secrets.randbits(64) or 1:016x}"
_unsampled_count = itertools.count(1)


def route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def make_middleware(telemetry: Telemetry) -> Middleware:
    """The traced middleware; with tracing off (or a request not sampled) it makes no trace (the
    request's `RequestMetrics` still carries the usage record and first-token time the metrics
    need)."""
    # OpenTelemetry warns, with the whole header, about each malformed `tracestate` it parses (that
    # logger's only warnings): one log line per request a client controls. The W3C rule, drop the
    # bad members, is kept; the warning is not.
    logging.getLogger("opentelemetry.trace.span").setLevel(logging.ERROR)
    metrics = telemetry.metrics
    is_tracing = telemetry.settings.is_tracing_enabled
    sample_bound, origin = telemetry.provider.bound, telemetry.origin
    max_per_s = telemetry.settings.max_traces_per_s
    limit = TraceRateLimit(max_per_s, time.perf_counter()) if max_per_s > 0 else None

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
        started = time.perf_counter()
        observer = (_observe(telemetry, request, route, started, sample_bound, limit, origin)
                    if is_tracing else RequestMetrics(telemetry, started))
        request[OBSERVER_KEY] = observer
        trace = observer.trace
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
            if not cancelled:
                _finish(telemetry, route, status, observer, response)
                if telemetry.access_log is not None:
                    _log_access(telemetry.access_log, request, status, observer, response)
            else:
                def finish() -> None:
                    record = observer.record
                    final = record.status if record is not None else status
                    _finish(telemetry, route, final, observer, response)
                    if telemetry.access_log is not None:
                        _log_access(telemetry.access_log, request, final, observer, response)

                if observer.is_admitted and observer.record is None:
                    observer.on_done = finish  # the settle is still running: wait for it
                else:
                    finish()
    return telemetry_middleware


def _observe(telemetry: Telemetry, request: web.Request, route: str, started: float,
             sample_bound: int, limit: TraceRateLimit | None, origin: TraceOrigin
             ) -> RequestMetrics:
    """The request's sampling decision, as its observer: `RequestTracing` with a `RequestTrace`
    when sampled (a child of the caller's sampled `traceparent`, or a new trace the rate limit
    allows and the ratio keeps), else `RequestMetrics` with the `traceparent` that passes the
    decision not to record on (W3C: the caller's trace id, if any, a span id of ours, flags
    without "sampled"; and its `tracestate`)."""
    parent = _incoming_span(request) if "traceparent" in request.headers else None
    if parent is None and limit is not None and not limit.allow(started):
        count = next(_unsampled_count)  # (over the limit: no ids drawn)
        observer = RequestMetrics(telemetry, started)
        observer.unsampled_traceparent = f"{_UNSAMPLED_PREFIX}{count:016x}-{count:016x}-00"
        return observer
    context = new_span_context(parent, sample_bound)
    # (SpanContext is a tuple: trace id, span id, is_remote, trace flags, ...)
    if context[3] & _SAMPLED:
        return RequestTracing(telemetry, started, RequestTrace(context, parent, request.method,
                                                               route, origin, time.time_ns()))
    if parent is None and limit is not None:
        limit.refund()
    observer = RequestMetrics(telemetry, started)
    observer.unsampled_traceparent = (f"00-{context[0]:032x}-{context[1]:016x}-"
                                      + TRACE_FLAGS_HEX[context[3] & ~_SAMPLED])
    if parent is not None and context[4]:  # (W3C: a received tracestate goes on, sampled or not)
        observer.unsampled_tracestate = context[4].to_header()
    return observer


def _incoming_span(request: web.Request) -> SpanContext | None:
    """The caller's span, from its W3C `traceparent` header; None when it is not valid."""
    parent = trace_api.get_current_span(PROPAGATOR.extract(request.headers)).get_span_context()
    return parent if parent.is_valid else None


def _finish(telemetry: Telemetry, route: str, status: int, observer: RequestMetrics,
            response: web.StreamResponse | None) -> None:
    trace = observer.trace
    if trace is not None:
        trace.status_code = status
        trace.end_ns = time.time_ns()
        telemetry.export(trace)
    metrics = telemetry.metrics
    latency_s = time.perf_counter() - observer.started
    record = observer.record
    model, project = ((record.model, record.project) if record is not None
                      else (observer.model, observer.project))
    metrics.requests_of[route, str(status), model, metrics.project_label[project]].inc()
    metrics.duration_of[route, model].observe(latency_s)
    overhead_s = None
    try:  # (not response.get: Mapping.get is two Python calls, this is one)
        overhead_ms = response[OVERHEAD_MS] if response is not None else None
    except KeyError:
        overhead_ms = None
    if overhead_ms is not None:
        overhead_s = overhead_ms / 1000.0
        metrics.overhead_of[(route,)].observe(overhead_s)
    ttft_s = None
    if record is not None and record.stream and observer.first_token_at is not None:
        ttft_s = observer.first_token_at - observer.started
        metrics.ttft_of[(model,)].observe(ttft_s)
    if record is not None:
        telemetry.latency.add(LatencySample(time.time(), model, latency_s, overhead_s, ttft_s))


def _log_access(access_log: AccessLog, request: web.Request, status: int,
                observer: RequestMetrics, response: web.StreamResponse | None) -> None:
    """The request's access line: its usage record's figures when it was metered, else what
    admission learnt (model, project); the trace id of a sampled trace, or the id its upstream
    calls carried unsampled."""
    record = observer.record
    trace = observer.trace
    if trace is not None:
        trace_id = trace.trace_id_hex
    elif observer.unsampled_traceparent is not None:
        trace_id = observer.unsampled_traceparent[3:35]  # 00-<32 hex>-<16 hex>-00
    else:
        trace_id = ""
    if response is not None:
        request_id = response.headers.get("x-request-id", "")
    else:  # no answer went out (the client left first): the id its usage record carries
        request_id = record.request_id.partition("/")[0] if record is not None else ""
    latency_ms = (time.perf_counter() - observer.started) * 1000.0
    if record is not None:
        access_log.write(request.method, request.path, status, record.model, record.project,
                         record.key_id, (record.prompt_tokens, record.cached_tokens,
                                         record.completion_tokens),
                         latency_ms, request_id, trace_id)
    else:  # refused before a record, or a route without one: who called, if known
        caller = observer.caller
        project, key_id = ((caller.project, caller.key_id) if caller is not None
                           else (observer.project, ""))
        access_log.write(request.method, request.path, status, observer.model, project,
                         key_id or "", (0, 0, 0), latency_ms, request_id, trace_id)
