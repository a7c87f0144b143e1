"""The two `RequestObserver`s (gateway/request/observer.py) the telemetry middleware makes, one
per request:

    RequestMetrics   every request: the facts the metrics and the access log need (its model
                     and project once admitted, its usage record, when a stream's first token
                     came), the routing-decision and fallback counters, the usage counters; and,
                     tracing on but the request not sampled, the `traceparent` (flags 00) its
                     upstream calls carry, so that a replica does not start a trace of its own
    RequestTracing   a sampled request: all of that, plus each fact noted in its `RequestTrace`
                     (time stamps, identity, each routing decision, each upstream call, the
                     record), from which its spans are built when read (request_trace.py)

Which one a request gets is decided by the middleware's sampling (middleware.py); with tracing
off every request gets `RequestMetrics`, which does no trace work at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from auth.principal import Principal
from gateway.fleet.endpoints import Endpoint
from gateway.metering.contract import UsageRecord
from gateway.request.canonical import CanonicalRequest
from gateway.request.errors import GatewayError
from gateway.request.observer import RequestObserver, UpstreamCallObserver
from gateway.routing.base import Decision, Router
from gateway.telemetry.request_trace import (
    FallbackStep,
    RequestTrace,
    RouteStep,
    request_values,
)
from gateway.upstream.transport import UpstreamRequest
from infra.telemetry.attributes import AIGW_REPLICA

if TYPE_CHECKING:
    from gateway.telemetry.telemetry import Telemetry

TRACE_FLAGS_HEX = tuple(f"{value:02x}" for value in range(256))  # trace flags -> two hex digits
_time_ns = time.time_ns
_perf_counter = time.perf_counter


class RequestMetrics(RequestObserver):
    """What a request's metrics need; read by the middleware once the answer is done."""

    __slots__ = ("caller", "first_token_at", "is_admitted", "model", "on_done", "project",
                 "record", "started", "telemetry", "unsampled_traceparent",
                 "unsampled_tracestate")
    trace: RequestTrace | None = None  # RequestTracing's

    def __init__(self, telemetry: Telemetry, started: float) -> None:
        self.telemetry = telemetry
        self.started = started  # time.perf_counter() when the request came in
        self.record: UsageRecord | None = None  # its own usage record, once settled
        self.first_token_at: float | None = None  # perf_counter of a stream's first event
        self.is_admitted = False  # the meter admitted it, so a settle (and a record) will follow
        # the metric labels once the request reached admission (its model configured, its
        # caller known), so a refusal there (429) is counted under them although it has no record
        self.model = ""
        self.project = ""
        # who called, once authenticated (the access log's project and key id for a request
        # refused after that and before a record: a 429, a bad body, an unknown model)
        self.caller: Principal | None = None
        self.on_done: Callable[[], None] | None = None  # the middleware's finish, if it must wait
        self.unsampled_traceparent: str | None = None  # tracing on, this request not sampled
        self.unsampled_tracestate: str | None = None  # the caller's `tracestate`, passed on

    def on_authenticated(self, started_ns: int, principal: Principal | None,
                         error_code: str | None) -> None:
        self.caller = principal

    def on_admitting(self, model: str, project: str) -> None:
        self.model, self.project = model, project  # (a configured model, never free client text)

    def on_admitted(self) -> None:
        self.is_admitted = True

    def on_routed(self, request: CanonicalRequest, candidates: Sequence[Endpoint],
                  decision: Decision, started_ns: int, router: Router) -> None:
        telemetry = self.telemetry
        telemetry.metrics.routing_decisions_of[telemetry.routing_policy, decision.reason,
                                               decision.endpoint.name].inc()

    def on_fallback(self, request: CanonicalRequest, from_model: str, to_model: str,
                    reason: str, error: GatewayError) -> None:
        self.telemetry.metrics.fallbacks_of(from_model, to_model, reason).inc()

    def on_refused(self, request: CanonicalRequest, model: str, retried: bool) -> None:
        self.telemetry.metrics.latency_refusals_of(model, request.service_tier or "default",
                                                   "retried" if retried else "passed_on").inc()

    def on_upstream_call(self, upstream: UpstreamRequest) -> UpstreamCallObserver | None:
        if self.unsampled_traceparent is not None:  # not sampled here: nor upstream
            upstream.headers["traceparent"] = self.unsampled_traceparent
            if self.unsampled_tracestate is not None:
                upstream.headers["tracestate"] = self.unsampled_tracestate
        return None

    def on_first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = _perf_counter()

    def on_settled(self, record: UsageRecord) -> None:
        self.record = record
        self.telemetry.observe_usage(record)
        if self.on_done is not None:
            self.on_done()

    def on_usage(self, record: UsageRecord) -> None:
        self.telemetry.observe_usage(record)


class RequestTracing(RequestMetrics):
    """A sampled request: `RequestMetrics`, and each fact into `trace` too. (The overrides that
    run on every sampled request do RequestMetrics' part inline rather than through `super()`:
    one Python call each instead of two.)"""

    __slots__ = ("_trace", "trace", "trace_id")

    def __init__(self, telemetry: Telemetry, started: float, trace: RequestTrace) -> None:
        # (RequestMetrics' fields set here, not through super().__init__: one call, not two)
        self.telemetry = telemetry
        self.started = started
        self.record = None
        self.first_token_at = None
        self.is_admitted = False
        self.model = self.project = ""
        self.caller = None
        self.on_done = None
        self.unsampled_traceparent = self.unsampled_tracestate = None
        self.trace = self._trace = trace  # (`_trace`: the same, typed as never None)
        self.trace_id = trace.trace_id_hex

    def on_authenticated(self, started_ns: int, principal: Principal | None,
                         error_code: str | None) -> None:
        self.caller = principal
        trace = self._trace
        trace.auth_start_ns, trace.auth_end_ns = started_ns, _time_ns()
        if principal is not None:
            trace.auth_identity = (principal.project, principal.key_id, principal.via)
        else:
            trace.auth_error = error_code

    def on_routed(self, request: CanonicalRequest, candidates: Sequence[Endpoint],
                  decision: Decision, started_ns: int, router: Router) -> None:
        telemetry = self.telemetry
        telemetry.metrics.routing_decisions_of[telemetry.routing_policy, decision.reason,
                                               decision.endpoint.name].inc()
        trace = self._trace
        if trace.request is None:
            trace.request = request_values(request)
        trace.add_route(RouteStep(started_ns, _time_ns(), telemetry.routing_policy, decision,
                                  candidates, router.explain(request.request_id)))

    def on_fallback(self, request: CanonicalRequest, from_model: str, to_model: str,
                    reason: str, error: GatewayError) -> None:
        super().on_fallback(request, from_model, to_model, reason, error)
        self._trace.add_fallback(FallbackStep(_time_ns(), from_model, to_model, reason, error.code))

    def on_upstream_call(self, upstream: UpstreamRequest) -> UpstreamCallObserver | None:
        """A CLIENT span for the call, whose id goes upstream in `traceparent` (what
        `TraceContextTextMapPropagator.inject` writes for it), so the replica continues it."""
        trace = self._trace
        name, attributes = _span_shape(upstream.method, upstream.url)
        call = trace.new_call(name, attributes, _time_ns())
        context = trace.context  # (a SpanContext tuple: trace id, span id, remote, flags, state)
        headers = upstream.headers
        headers["traceparent"] = ("00-" + trace.trace_id_hex + "-"
                                  + call.span_id.to_bytes(8, "big").hex() + "-"
                                  + TRACE_FLAGS_HEX[context[3]])
        if trace.parent is not None and context[4]:  # (a new trace's state is the empty default)
            headers["tracestate"] = context[4].to_header()
        return call

    def on_first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = _perf_counter()
        calls = self._trace.calls
        if calls and calls[-1].first_line_ns is None:
            calls[-1].first_line_ns = _time_ns()

    def on_cache_turn(self, turn: Any) -> None:
        self._trace.cache_turn = turn

    def on_settled(self, record: UsageRecord) -> None:
        self._trace.record = record
        self.record = record
        self.telemetry.observe_usage(record)
        if self.on_done is not None:
            self.on_done()


@lru_cache(maxsize=1024)
def _span_shape(method: str, url: str) -> tuple[str, dict[str, Any]]:
    """(span name, attributes) of a call; a gateway calls few distinct URLs, so each is parsed once
    (the dict is shared by every call to that URL: read, never written)."""
    parts = urlsplit(url)
    return (f"upstream {method} {parts.path}",
            {"http.request.method": method, "url.full": url, "server.address": parts.hostname or "",
             "server.port": parts.port or 0, AIGW_REPLICA: parts.netloc})
