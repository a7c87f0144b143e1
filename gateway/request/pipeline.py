"""The one request pipeline every dialect runs through. `Pipeline.handle` reads as its steps:

    admit      gateway/request/admission.py: request id -> authenticate -> body cap -> parse +
               validate (the dialect) -> scope & model -> the prompt's tokens -> meter.admit
    guard      the request guards (gateway/guardrails/) after admission, before dispatch; the
               answer's events pass through the response guards in respond / stream
    dispatch   gateway/request/dispatch.py: pick an endpoint, its first event, retries before
               it, down the model's fallback chain (gateway/request/fallback.py)
    respond    gateway/request/answer.py: the whole answer, or
    stream     ... the dialect's events as they come
    settle     the request's `Settlement` (gateway/request/settlement.py): exactly once per
               admitted request, also on disconnect and failure; queued, so the answer never
               waits for the usage write, except when the request counts against rate limits
               or a budget: then it settles before the answer goes out, so the caller's next
               request sees its real token count

What telemetry learns of a request it learns from the request's observer
(gateway/request/observer.py), which each step tells explicitly. The request's state from
dispatch to settle is one `RequestState` (gateway/request/state.py).

Errors before admission answer in the dialect's envelope and are never metered. After the stream
has started, a failure ends it with the dialect's error event (status 200 already sent).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from auth.principal import Authenticator, AuthError, Principal
from gateway.dialects.base import Dialect
from gateway.fleet.endpoints import Fleet, ModelRoute
from gateway.guardrails.chain import build_chain
from gateway.metering.contract import Admission, Meter, RateLimited, UsageRecord
from gateway.request.admission import (
    Admitter,
    CacheSaltOf,
    default_cache_salt_of,
    request_ids_of,
)
from gateway.request.answer import Answerer, error_response, may_see_overhead
from gateway.request.cache_explainer import CacheExplainer, session_of
from gateway.request.canonical import CanonicalRequest, PromptUsage, Usage
from gateway.request.dispatch import Attempt, Timing
from gateway.request.errors import (
    GatewayError,
    UpstreamAnswerTooLarge,
    UpstreamError,
    UpstreamThrottled,
)
from gateway.request.fallback import FallbackChains
from gateway.request.keeper import AnswerKeeper
from gateway.request.observer import RequestObserver, observer_of
from gateway.request.settlement import Settler
from gateway.request.state import RequestState
from gateway.request.usage import STATUS_CLIENT_CLOSED
from gateway.request_logs import RequestLog
from gateway.routing.base import Router
from gateway.settings import GatewaySettings
from gateway.upstream.retry_budget import RetryBudget
from gateway.upstream.wait_timer import Watchdog

__all__ = ["CacheSaltOf", "Pipeline", "default_cache_salt_of"]


class Pipeline:
    def __init__(self, settings: GatewaySettings, authenticator: Authenticator, meter: Meter,
                 router: Router, fleet: Fleet, cache_salt_of: CacheSaltOf = default_cache_salt_of
                 ) -> None:
        self.settings = settings
        self.cache_salt_of = cache_salt_of
        self.authenticator = authenticator
        self.meter = meter
        self._router = router
        self.fleet = fleet
        self.retry_budget = RetryBudget(settings.retry_budget_ratio, settings.num_retries_reserve)
        self.draining = False
        watchdog = Watchdog()  # the upstream waits' timeouts
        self._chains = FallbackChains(settings, fleet, self.retry_budget, watchdog)
        self.admitter = Admitter(settings, authenticator, meter, router, fleet, self._chains,
                                 cache_salt_of)
        self.answerer = Answerer(settings, router, watchdog)
        self.settler = Settler(meter)
        # each session's previous turn, to say where a prompt diverged (x-aigw-debug: 1, traces)
        self.cache_explainer = CacheExplainer(settings.cache_explainer_max_bytes)
        # guardrails (gateway/guardrails/); None: off, nothing done per request
        self.guardrails = build_chain(settings, fleet, router, self.retry_budget, watchdog, meter)
        # what requests made outside HTTP (batch lines) tell telemetry (set by the app)
        self.background_observer = RequestObserver()

    @property
    def router(self) -> Router:
        return self._router

    @router.setter
    def router(self, router: Router) -> None:
        """Another router for every step (a test's): admission's cache estimate, dispatch, the
        debug header's explanation."""
        self._router = self.admitter.router = self.answerer.router = router

    @property
    def fallback_chains(self) -> dict[str, tuple[str, ...]]:
        """model name -> the models its requests go on to, in order (only models with
        `fallbacks`; gateway/request/fallback.py)."""
        return self._chains.chains

    @property
    def request_log(self) -> RequestLog | None:
        """The request log (gateway/request_logs/; set by the served app, whose store it is);
        None: off, nothing done per request."""
        return self.settler.request_log

    @request_log.setter
    def request_log(self, request_log: RequestLog | None) -> None:
        self.settler.request_log = self.admitter.request_log = request_log

    async def handle(self, request: web.Request, dialect: Dialect,
                     keeper: AnswerKeeper | None = None) -> web.StreamResponse:
        """`keeper`: what a stateful API stores of its answers (gateway/request/keeper.py)."""
        timing = Timing(time.perf_counter())
        request_id, usage_id = request_ids_of(request)
        observer = observer_of(request)
        try:
            if self.draining:
                raise GatewayError("the gateway is shutting down", status=503, code="draining")
            canonical, principal, route, admission = await self.admitter.admit(
                request, dialect, request_id, usage_id, keeper, observer)
        except GatewayError as exc:
            return error_response(dialect, exc.status, exc.code, exc.message, request_id,
                                  timing.overhead_ms(), param=exc.param, error_type=exc.error_type)
        except AuthError as exc:
            return error_response(dialect, exc.status, exc.code, exc.message, request_id,
                                  timing.overhead_ms())
        except RateLimited as exc:
            return error_response(dialect, 429, "rate_limit_exceeded", exc.message, request_id,
                                  timing.overhead_ms(), headers=exc.headers)
        state = self._state(request, dialect, canonical, principal, route, admission, usage_id,
                            timing, keeper)
        try:
            if state.guards is not None:  # (a block is a 400, settled like any refusal)
                await state.guards.check_request(canonical)
            # dispatch: an endpoint's first event, from the model or one down its fallback chain
            attempt = await self._chains.dispatch(canonical, state.route, self._router,
                                                  state.timing)
            self._dispatched(state, attempt)
            if canonical.stream:
                return await self.answerer.stream(state, attempt)
            return await self.answerer.respond(state, attempt)
        except GatewayError as exc:
            return await self._refuse(state, exc)
        except asyncio.CancelledError:  # the client went away while we waited
            state.status = STATUS_CLIENT_CLOSED
            raise
        finally:
            await state.settlement.settle()  # (a no-op when settled before the answer)
            if state.turn is not None:
                self._settle_turn(state)

    def _state(self, request: web.Request, dialect: Dialect, canonical: CanonicalRequest,
               principal: Principal, route: ModelRoute, admission: Admission, usage_id: str,
               timing: Timing, keeper: AnswerKeeper | None) -> RequestState:
        """The admitted request's state, with its one `Settlement`."""
        state = RequestState(request, dialect, canonical, principal, route, admission, usage_id,
                             timing)
        state.settlement = self.settler.open(state)
        state.keeper = keeper
        state.show_overhead = not self.settings.auth_enabled or may_see_overhead(principal)
        state.is_logged = canonical.is_logged and self.settler.request_log is not None
        if self.guardrails:
            state.guards = self.guardrails.for_request(canonical, principal)
        state.debug = request.headers.get("x-aigw-debug") == "1"
        state.explain_route = state.debug and state.show_overhead  # replicas' load: operators
        return state

    def _dispatched(self, state: RequestState, attempt: Attempt) -> None:
        """Who answers: the attempt's endpoint, of the model or one down its fallback chain
        (gateway/request/fallback.py; routing and retries: gateway/request/dispatch.py). After a
        hop the answer names the model that served it, which the usage record bills. (A plain
        function after the awaited dispatch, not a coroutine around it: every resume of the
        request while it waits for the upstream passes one frame fewer.)"""
        canonical = state.canonical
        state.replica, state.endpoint = attempt.endpoint.name, attempt.endpoint
        if attempt.route is not state.route:
            state.route = attempt.route
            canonical.model = attempt.route.settings.name
        if self.cache_explainer.max_bytes and session_of(canonical) is not None:
            # this request as its session's next turn: where its prompt diverged from the
            # previous turn's (gateway/request/cache_explainer.py), for the trace and headers
            state.turn = self.cache_explainer.explain(canonical)
            if state.turn is not None:
                canonical.observer.on_cache_turn(state.turn)
            if isinstance(attempt.first_event, PromptUsage):  # a replica's stream announces it
                state.announced = attempt.first_event

    async def _refuse(self, state: RequestState, exc: GatewayError) -> web.Response:
        """An admitted request that ends in an error before its answer started (a guard's
        block, no endpoint, an upstream's refusal): settled, then the dialect's error."""
        state.status = exc.status
        state.error = (exc.code, exc.message)
        if isinstance(exc, UpstreamAnswerTooLarge):
            # the upstream computed an answer the gateway would not read: billed as admitted
            # (prompt estimate, max_tokens a choice), finish_reason "error" as a cut stream's
            state.accumulator.add(Usage(*state.canonical.admitted_tokens))
            state.accumulator.finish_reason = "error"
        if isinstance(exc, UpstreamError) and exc.endpoint_name:
            state.replica = exc.endpoint_name  # the endpoint that answered with the error
            if exc.model_name != state.route.settings.name:  # a fallback's: bill it there
                state.route = self.fleet.get(exc.model_name or "") or state.route
        if state.settles_before_answer:  # (an upstream refusal: its reservation is
            await state.settlement.settle(queue=False)  # released before the caller's next)
        headers = state.admission.headers
        if isinstance(exc, UpstreamThrottled):  # the upstream's retry-after, x-ratelimit-*
            headers = {**headers, **exc.headers}
        return error_response(state.dialect, exc.status, exc.code, exc.message,
                              state.canonical.request_id, state.timing.overhead_ms(),
                              state.replica, headers=headers, param=exc.param,
                              error_type=exc.error_type, show_overhead=state.show_overhead)

    def _settle_turn(self, state: RequestState) -> None:
        """The turn's prompt and cached tokens, for the dashboard's session view."""
        usage = state.accumulator.usage or state.accumulator.prompt_usage
        session = session_of(state.canonical)
        if usage is not None and state.turn is not None and session is not None:
            self.cache_explainer.settle(state.turn, usage.prompt_tokens, usage.cached_tokens,
                                        state.canonical.project or "", session)

    # ---- for the routes beside `handle` (count_tokens) and shutdown ------------------------
    async def authorize(self, request: web.Request, parse: Callable[[Any, str], CanonicalRequest],
                        request_id: str) -> tuple[CanonicalRequest, Principal, ModelRoute]:
        """Admission's first checks (gateway/request/admission.py: `Admitter.authorize`)."""
        return await self.admitter.authorize(request, parse, request_id, observer_of(request))

    async def settle(self, admission: Admission, record: UsageRecord,
                     observer: RequestObserver | None = None) -> None:
        """Settle now (for a route outside `handle`, e.g. count_tokens); never raises."""
        try:
            await self.settler.settle_now(admission, record)
        finally:
            if observer is not None:
                observer.on_settled(record)

    async def wait_settled(self, timeout_s: float = 5.0) -> None:
        """Shutdown, before the meter closes: let the settlements still counting a prompt finish."""
        await self.settler.wait_settled(timeout_s)
