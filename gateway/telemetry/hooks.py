"""Observing decorators the gateway's Pipeline is built with (gateway/app.py):

    TracedAuthenticator   a `gateway.auth` span; project and key id on the request span
    CountedRouter         the routing-decisions counter (tracing off: no span work at all)
    TracedRouter          that, plus a `gateway.route` span per decision (candidates, matched
                          blocks, scores) and the request's GenAI attributes
    ObservedMeter         on settle: usage attributes on the request span, token/cost metrics,
                          the dashboard's usage series

Each forwards everything else to the object it wraps (`__getattr__`; the routers forward the
`Router` methods explicitly), and never changes what it returns or raises. Which ones wrap is
decided once, when the app is built (gateway/telemetry/telemetry.py); spans get their attributes
at creation where they are known then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.trace import StatusCode, Tracer

from auth.principal import Authenticator, AuthError, Principal
from gateway.canonical import CanonicalRequest
from gateway.endpoints import Endpoint, Fleet
from gateway.metering.contract import Admission, Meter, UsageRecord
from gateway.routing.base import Decision, Router
from gateway.telemetry import attributes as attr
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.observation import current_observation


class TracedAuthenticator:
    def __init__(self, inner: Authenticator, tracer: Tracer) -> None:
        self.inner = inner
        self._tracer = tracer

    async def authenticate(self, credential: str | None) -> Principal:
        span = self._tracer.start_span("gateway.auth")
        try:
            principal = await self.inner.authenticate(credential)
        except AuthError as exc:
            span.set_status(StatusCode.ERROR, exc.code)
            span.end()
            raise
        except BaseException:
            span.end()
            raise
        identity = {attr.AIGW_PROJECT: principal.project, attr.AIGW_KEY_ID: principal.key_id}
        if span.is_recording():
            span.set_attributes({**identity, "aigw.auth.via": principal.via})
        span.end()
        observation = current_observation()
        if observation is not None and observation.span is not None:
            observation.span.set_attributes(identity)
        return principal

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class CountedRouter(Router):
    """Counts each decision in aigw_routing_decisions_total; nothing else."""

    def __init__(self, inner: Router, metrics: GatewayMetrics, policy: str) -> None:
        self.inner = inner
        self._policy = policy
        self._decisions_of = metrics.routing_decisions_of

    def pick(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        decision = self.inner.pick(request, endpoints)
        self._decisions_of(self._policy, decision.reason, decision.endpoint.name).inc()
        return decision

    async def choose(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        decision = await self.inner.choose(request, endpoints)
        self._decisions_of(self._policy, decision.reason, decision.endpoint.name).inc()
        return decision

    async def start(self, fleet: Fleet) -> None:
        await self.inner.start(fleet)

    async def close(self) -> None:
        await self.inner.close()

    async def on_endpoints_changed(self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
                                   ) -> None:
        await self.inner.on_endpoints_changed(added, removed)

    def explain(self, request_id: str) -> str | None:
        return self.inner.explain(request_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TracedRouter(CountedRouter):
    def __init__(self, inner: Router, tracer: Tracer, metrics: GatewayMetrics, policy: str) -> None:
        super().__init__(inner, metrics, policy)
        self._tracer = tracer

    def pick(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        started_ns = time.time_ns()
        decision = super().pick(request, endpoints)
        self._trace(request, endpoints, decision, started_ns)
        return decision

    async def choose(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        started_ns = time.time_ns()
        decision = await self.inner.choose(request, endpoints)  # (one coroutine layer, not two)
        self._decisions_of(self._policy, decision.reason, decision.endpoint.name).inc()
        self._trace(request, endpoints, decision, started_ns)
        return decision

    def _trace(self, request: CanonicalRequest, endpoints: Sequence[Endpoint], decision: Decision,
               started_ns: int) -> None:
        observation = current_observation()
        span = observation.span if observation is not None else None
        if span is None or not span.is_recording():
            return  # not traced, or not sampled: the children are not either
        span.set_attributes(request_attributes(request))
        values = {attr.AIGW_ROUTING_POLICY: self._policy, attr.AIGW_ROUTING_REASON: decision.reason,
                  attr.AIGW_REPLICA: decision.endpoint.name,
                  **candidate_attributes(decision, endpoints)}
        explanation = self.inner.explain(request.request_id)
        if explanation:
            values[attr.AIGW_ROUTING_EXPLAIN] = explanation
        self._tracer.start_span("gateway.route", start_time=started_ns, attributes=values).end()


def request_attributes(request: CanonicalRequest) -> dict[str, Any]:
    values: dict[str, Any] = {attr.GEN_AI_OPERATION: attr.OPERATION_BY_KIND.get(request.kind, request.kind),
                              attr.GEN_AI_SYSTEM: "aigw", attr.GEN_AI_REQUEST_MODEL: request.model,
                              attr.AIGW_REQUEST_ID: request.request_id, attr.AIGW_STREAM: request.stream}
    if request.max_tokens is not None:
        values[attr.GEN_AI_REQUEST_MAX_TOKENS] = request.max_tokens
    if request.temperature is not None:
        values[attr.GEN_AI_REQUEST_TEMPERATURE] = request.temperature
    if request.top_p is not None:
        values[attr.GEN_AI_REQUEST_TOP_P] = request.top_p
    if request.seed is not None:
        values[attr.GEN_AI_REQUEST_SEED] = request.seed
    return values


def candidate_attributes(decision: Decision, endpoints: Sequence[Endpoint]) -> dict[str, Any]:
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


class ObservedMeter:
    """`settle_nowait` exists exactly when the inner meter has one (the pipeline looks for it)."""

    def __init__(self, inner: Meter, on_record: Callable[[UsageRecord], None]) -> None:
        self.inner = inner
        self._on_record = on_record
        inner_nowait = getattr(inner, "settle_nowait", None)
        if inner_nowait is not None:
            def settle_nowait(admission: Admission, record: UsageRecord) -> None:
                try:
                    inner_nowait(admission, record)
                finally:
                    on_record(record)

            self.settle_nowait = settle_nowait

    async def admit(self, request_id: str, principal: Principal, model: str,
                    num_prompt_tokens: int, max_tokens: int) -> Admission:
        admission = await self.inner.admit(request_id, principal, model, num_prompt_tokens, max_tokens)
        observation = current_observation()
        if observation is not None:
            observation.is_admitted = True
        return admission

    async def settle(self, admission: Admission, record: UsageRecord) -> None:
        try:
            await self.inner.settle(admission, record)
        finally:
            self._on_record(record)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


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
