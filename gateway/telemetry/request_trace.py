"""RequestTrace: the raw facts of one traced gateway request, made into OpenTelemetry spans only
when somebody reads them.

The request path writes plain values here: ids, `time.time_ns()` stamps, and references to
small objects the pipeline holds anyway (the routing decision, the usage record). It builds no
span, no attribute dict and no event. `spans()` builds the SDK's `ReadableSpan`s from them, once,
when the dashboard's buffer is read or an exporter takes the trace:

    POST /v1/chat/completions   SERVER    continues an incoming traceparent; GenAI request and
                                          usage attributes, project, key id, status code
      gateway.auth              INTERNAL  project, key id, how the caller proved it (or the error)
      gateway.route             INTERNAL  one per routing decision (a retry decides again):
                                          policy, reason, model, replica, candidates, matched
                                          blocks, scores
      gateway.fallback          INTERNAL  one per hop down a fallback chain: from and to model,
                                          reason, the error code that made it
      upstream POST /v1/...     CLIENT    one per upstream call; its span id is the `traceparent`
                                          the replica continues; a `first_line` event

Only what must exist during the request is made then: the trace id (the `x-aigw-trace-id`
header), the SERVER span's id and each upstream call's id (the `traceparent` sent upstream).
Written and read by the event loop only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

from gateway.metering.contract import UsageRecord
from gateway.request.observer import UpstreamCallObserver
from infra.telemetry import attributes as attr
from infra.telemetry.attributes import exception_attributes
from infra.telemetry.lean_tracer import new_span_id

_time_ns = time.time_ns
_UNSET = Status(StatusCode.UNSET)
_ERROR = Status(StatusCode.ERROR)
_STREAM_BROKE = Status(StatusCode.ERROR, "the answer ended in an error after it had started")


@dataclass(frozen=True, slots=True)
class TraceOrigin:
    """Who made the spans: the gateway's resource (service.name) and instrumentation scope."""

    resource: Resource
    scope: InstrumentationScope


@dataclass(slots=True)
class RouteStep:
    start_ns: int
    end_ns: int
    policy: str
    decision: Any  # gateway.routing.base.Decision (`scores` read when the span is built)
    candidates: Sequence[Any]  # the endpoints it chose among
    explanation: str | None


@dataclass(frozen=True, slots=True)
class FallbackStep:
    at_ns: int
    from_model: str
    to_model: str
    reason: str
    error_code: str


class UpstreamCall(UpstreamCallObserver):
    """One upstream call of a traced request, and its observer (the backend that makes the call
    tells it; the fields that are often unset default to None at class level, so a call is made
    with four writes)."""

    end_ns: int | None = None
    status_code: int | None = None
    first_line_ns: int | None = None
    exception: dict[str, Any] | None = None  # the `exception` event's attributes, if it failed

    def __init__(self, span_id: int, name: str, attributes: dict[str, Any], start_ns: int) -> None:
        self.span_id = span_id  # the id sent upstream in `traceparent`
        self.name = name  # "upstream POST /v1/chat/completions"
        # shared per URL (gateway/telemetry/observers.py): never written
        self.attributes = attributes
        self.start_ns = start_ns

    def on_answered(self, status: int) -> None:
        self.status_code = status

    def on_failed(self, exc: BaseException) -> None:
        if self.exception is None:  # (the first failure is the call's)
            self.end_ns = _time_ns()
            self.exception = exception_attributes(exc)

    def on_ended(self) -> None:
        if self.end_ns is None:
            self.end_ns = _time_ns()


class RequestTrace:
    """Made by the middleware for a sampled request; the fields it does not set start as class
    defaults (a trace is made with seven writes: it is on every request's path)."""

    end_ns: int = 0
    status_code: int | None = None
    auth_start_ns: int = 0
    auth_end_ns: int = 0
    auth_identity: tuple[str, str, str] | None = None  # (project, key id, via)
    auth_error: str | None = None
    request: tuple[Any, ...] | None = None  # `request_values()`, set by the first routing decision
    routes: tuple[RouteStep, ...] = ()  # each routing decision, in order
    calls: tuple[UpstreamCall, ...] = ()  # each upstream call, in order
    fallbacks: tuple[FallbackStep, ...] = ()  # each hop down a fallback chain, in order
    cache_turn: Any = None  # gateway.request.cache_explainer.SessionTurn: the session's turn
    record: UsageRecord | None = None
    _spans: list[ReadableSpan] | None = None

    def __init__(self, context: SpanContext, parent: SpanContext | None, method: str, route: str,
                 origin: TraceOrigin, start_ns: int) -> None:
        self.context = context  # the SERVER span's; sampled (unsampled requests get no trace)
        self.parent = parent  # the caller's span, from its traceparent
        self.method = method
        self.route = route
        self.origin = origin
        self.start_ns = start_ns
        # 32 hex digits: the `x-aigw-trace-id` header and the `traceparent` sent upstream
        # (SpanContext is a tuple: the trace id first; to_bytes().hex() is ~2x an f-string's :032x)
        self.trace_id_hex = context[0].to_bytes(16, "big").hex()

    def add_route(self, step: RouteStep) -> None:
        self.routes += (step,)

    def add_fallback(self, step: FallbackStep) -> None:
        self.fallbacks += (step,)

    def new_call(self, name: str, attributes: dict[str, Any], start_ns: int) -> UpstreamCall:
        call = UpstreamCall(new_span_id(), name, attributes, start_ns)
        self.calls += (call,)
        return call

    def spans(self) -> list[ReadableSpan]:
        """The request's spans, SERVER first (built on the first call, then kept)."""
        if self._spans is None:
            self._spans = _build(self, self.origin.resource, self.origin.scope)
        return self._spans


def request_values(request: Any) -> tuple[Any, ...]:
    """What the SERVER span reports of a `CanonicalRequest` (a few scalars, not the request,
    so a buffered trace never holds a request's messages)."""
    return (request.kind, request.model, request.request_id, request.stream, request.max_tokens,
            request.temperature, request.top_p, request.seed)


def _build(trace: RequestTrace, resource: Resource,
           scope: InstrumentationScope) -> list[ReadableSpan]:
    server = trace.context

    def child(name: str, span_id: int, kind: SpanKind, attributes: dict[str, Any], start_ns: int,
              end_ns: int, status: Status = _UNSET, events: Sequence[Event] = ()) -> ReadableSpan:
        context = SpanContext(server.trace_id, span_id, False, server.trace_flags,
                              server.trace_state)
        return ReadableSpan(name, context, server, resource, attributes, events, (), kind, None,
                            status, start_ns, end_ns, scope)

    values: dict[str, Any] = {"http.request.method": trace.method, "http.route": trace.route}
    spans: list[ReadableSpan] = []
    if trace.auth_start_ns:
        auth: dict[str, Any] = {}
        if trace.auth_identity is not None:
            project, key_id, via = trace.auth_identity
            identity = {attr.AIGW_PROJECT: project, attr.AIGW_KEY_ID: key_id}
            values.update(identity)
            auth = {**identity, "aigw.auth.via": via}
        status = Status(StatusCode.ERROR, trace.auth_error) if trace.auth_error else _UNSET
        spans.append(child("gateway.auth", new_span_id(), SpanKind.INTERNAL, auth,
                           trace.auth_start_ns, trace.auth_end_ns, status))
    if trace.request is not None:
        values.update(_request_attributes(trace.request))
    for step in trace.routes:
        route = {attr.AIGW_ROUTING_POLICY: step.policy,
                 attr.AIGW_ROUTING_REASON: step.decision.reason,
                 attr.AIGW_REPLICA: step.decision.endpoint.name,
                 attr.AIGW_ROUTING_MODEL: step.decision.endpoint.model.name,
                 **candidate_attributes(step.decision, step.candidates)}
        if step.explanation:
            route[attr.AIGW_ROUTING_EXPLAIN] = step.explanation
        spans.append(child("gateway.route", new_span_id(), SpanKind.INTERNAL, route, step.start_ns,
                           step.end_ns))
    for hop in trace.fallbacks:
        spans.append(child("gateway.fallback", new_span_id(), SpanKind.INTERNAL, {
            attr.AIGW_FALLBACK_FROM: hop.from_model, attr.AIGW_FALLBACK_TO: hop.to_model,
            attr.AIGW_FALLBACK_REASON: hop.reason, attr.AIGW_FALLBACK_ERROR: hop.error_code},
            hop.at_ns, hop.at_ns))
    for call in trace.calls:
        upstream = dict(call.attributes)
        events = []
        status = _UNSET
        if call.first_line_ns is not None:
            events.append(Event("first_line", {}, call.first_line_ns))
        if call.status_code is not None:
            upstream["http.response.status_code"] = call.status_code
            if call.status_code >= 400:
                status = _ERROR
        if call.exception is not None:
            events.append(Event("exception", call.exception, call.end_ns))
            status = Status(StatusCode.ERROR, call.exception["exception.type"].rsplit(".", 1)[-1])
        spans.append(child(call.name, call.span_id, SpanKind.CLIENT, upstream, call.start_ns,
                           call.end_ns or trace.end_ns, status, events))
    if trace.cache_turn is not None:
        values.update(cache_turn_attributes(trace.cache_turn))
    if trace.record is not None:
        values.update(usage_attributes(trace.record))
    if trace.status_code is not None:
        values["http.response.status_code"] = trace.status_code
    status = _ERROR if (trace.status_code or 0) >= 500 else _UNSET
    if trace.record is not None and trace.record.finish_reason == "error":
        status = _STREAM_BROKE  # a 200 whose answer ended in an error event (HTTP semconv: ERROR)
    root = ReadableSpan(f"{trace.method} {trace.route}", server, trace.parent, resource, values, (),
                        (), SpanKind.SERVER, None, status, trace.start_ns, trace.end_ns, scope)
    return [root, *spans]


def _request_attributes(values: tuple[Any, ...]) -> dict[str, Any]:
    kind, model, request_id, stream, max_tokens, temperature, top_p, seed = values
    found: dict[str, Any] = {attr.GEN_AI_OPERATION: attr.OPERATION_BY_KIND.get(kind, kind),
                             attr.GEN_AI_SYSTEM: "aigw", attr.GEN_AI_REQUEST_MODEL: model,
                             attr.AIGW_REQUEST_ID: request_id, attr.AIGW_STREAM: stream}
    for key, value in ((attr.GEN_AI_REQUEST_MAX_TOKENS, max_tokens),
                       (attr.GEN_AI_REQUEST_TEMPERATURE, temperature),
                       (attr.GEN_AI_REQUEST_TOP_P, top_p), (attr.GEN_AI_REQUEST_SEED, seed)):
        if value is not None:
            found[key] = value
    return found


def candidate_attributes(decision: Any, endpoints: Sequence[Any]) -> dict[str, Any]:
    """Per-candidate arrays from whatever the decision carries: `scores` (objects with `name`,
    `num_matched_blocks`, `cost`) when the router scores, else just the candidate names."""
    scores = getattr(decision, "scores", None) or ()
    names = [str(getattr(s, "name", "")) for s in scores]
    if not names:
        return {attr.AIGW_ROUTING_CANDIDATES: [e.name for e in endpoints]}
    values: dict[str, Any] = {attr.AIGW_ROUTING_CANDIDATES: names}
    matched = [getattr(s, "num_matched_blocks", None) for s in scores]
    if all(isinstance(m, int) for m in matched):
        values[attr.AIGW_ROUTING_MATCHED_BLOCKS] = matched
    costs = [getattr(s, "cost", None) for s in scores]
    if all(isinstance(c, int | float) for c in costs):
        values[attr.AIGW_ROUTING_SCORES] = [float(c) for c in costs]  # type: ignore[arg-type]
    return values


def cache_turn_attributes(turn: Any) -> dict[str, Any]:
    """A session's turn (gateway/request/cache_explainer.py): where its prompt diverged from
    the previous turn's; the hit itself is `aigw.cached_tokens` of the usage."""
    values: dict[str, Any] = {attr.AIGW_CACHE_SESSION_TURN: turn.turn,
                              attr.AIGW_CACHE_DIVERGENCE: "none"}
    if turn.divergence is not None:
        values[attr.AIGW_CACHE_DIVERGENCE] = turn.divergence.where
        values[attr.AIGW_CACHE_DIVERGENCE_TOKEN] = turn.divergence.token_index
        values[attr.AIGW_CACHE_DIVERGENCE_EXACT] = turn.divergence.is_exact
    return values


def usage_attributes(record: UsageRecord) -> dict[str, Any]:
    values: dict[str, Any] = {
        attr.GEN_AI_RESPONSE_MODEL: record.model, attr.GEN_AI_INPUT_TOKENS: record.prompt_tokens,
        attr.GEN_AI_OUTPUT_TOKENS: record.completion_tokens,
        attr.AIGW_CACHED_TOKENS: record.cached_tokens, attr.AIGW_COST_USD: record.cost_usd,
        attr.AIGW_PROJECT: record.project, attr.AIGW_KEY_ID: record.key_id,
        attr.AIGW_REPLICA: record.endpoint}
    if record.finish_reason:
        values[attr.GEN_AI_FINISH_REASONS] = [record.finish_reason]
    return values
