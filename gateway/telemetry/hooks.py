"""Observing decorators the gateway's Pipeline is built with (gateway/web/app.py):

    TracedAuthenticator   notes the auth step (times, identity or error) in the request's trace
    CountedRouter         the routing-decisions counter (tracing off: no trace work at all)
    TracedRouter          that, plus each decision (candidates, matched blocks, scores) noted in
                          the request's trace
    ObservedMeter         on settle: the usage record to the request's observation (its trace,
                          the token/cost metrics, the dashboard's usage series)

Each forwards everything else to the object it wraps (`__getattr__`; the routers forward the
`Router` methods explicitly), and never changes what it returns or raises. Which ones wrap is
decided once, when the app is built (gateway/telemetry/telemetry.py). They write plain values
into the request's `RequestTrace`; spans are built from it only when read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from auth.principal import Authenticator, AuthError, Principal
from gateway.fleet.endpoints import Endpoint, Fleet
from gateway.metering.contract import Admission, Meter, UsageRecord
from gateway.request.canonical import CanonicalRequest
from gateway.routing.base import Decision, Router
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.observation import current_observation
from gateway.telemetry.request_trace import RequestTrace, RouteStep, request_values

_time_ns = time.time_ns


class TracedAuthenticator:
    def __init__(self, inner: Authenticator) -> None:
        self.inner = inner

    def authenticate(self, credential: str | None) -> Coroutine[Any, Any, Principal]:
        """The inner authenticator's own coroutine for a request not traced (no coroutine
        layer of ours), else one that notes the step."""
        observation = current_observation()
        trace = observation.trace if observation is not None else None
        if trace is None:
            return self.inner.authenticate(credential)
        return self._traced(trace, credential)

    async def _traced(self, trace: RequestTrace, credential: str | None) -> Principal:
        trace.auth_start_ns = _time_ns()
        try:
            principal = await self.inner.authenticate(credential)
        except AuthError as exc:
            trace.auth_error = exc.code
            raise
        finally:
            trace.auth_end_ns = _time_ns()
        trace.auth_identity = (principal.project, principal.key_id, principal.via)
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

    async def expected_cached_tokens(self, request: CanonicalRequest,
                                     endpoints: Sequence[Endpoint]) -> int:
        return await self.inner.expected_cached_tokens(request, endpoints)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TracedRouter(CountedRouter):
    """A request that is not traced (or not sampled) is only counted, as by CountedRouter."""

    def pick(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        observation = current_observation()
        trace = observation.trace if observation is not None else None
        if trace is None:
            return super().pick(request, endpoints)
        started_ns = _time_ns()
        decision = super().pick(request, endpoints)
        self._note(trace, request, endpoints, decision, started_ns)
        return decision

    async def choose(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        observation = current_observation()
        trace = observation.trace if observation is not None else None
        started_ns = _time_ns() if trace is not None else 0
        decision = await self.inner.choose(request, endpoints)  # (one coroutine layer, not two)
        self._decisions_of(self._policy, decision.reason, decision.endpoint.name).inc()
        if trace is not None:
            self._note(trace, request, endpoints, decision, started_ns)
        return decision

    def _note(self, trace: RequestTrace, request: CanonicalRequest, endpoints: Sequence[Endpoint],
              decision: Decision, started_ns: int) -> None:
        if trace.request is None:
            trace.request = request_values(request)
        trace.add_route(RouteStep(started_ns, _time_ns(), self._policy, decision, endpoints,
                                  self.inner.explain(request.request_id)))


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

    def counts_tokens(self, principal: Principal) -> bool:
        counts = getattr(self.inner, "counts_tokens", None)
        return bool(counts is not None and counts(principal))

    async def admit(self, request_id: str, principal: Principal, model: str,
                    num_prompt_tokens: int, max_tokens: int) -> Admission:
        observation = current_observation()
        if observation is not None:  # (model is a configured one here, never free client text)
            observation.model, observation.project = model, principal.project
        admission = await self.inner.admit(request_id, principal, model, num_prompt_tokens, max_tokens)
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
