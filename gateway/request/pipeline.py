"""The one request pipeline every dialect runs through; `Pipeline.handle` reads as its steps:

    admit      `_admit`: request id -> authenticate (a bad body without a credential is a 401)
               -> body cap -> parse + validate (dialect) -> require scope & model -> meter.admit
    guard      the request guards (gateway/guardrails/) after admission, before dispatch; the
               answer's events pass through the response guards in respond / stream
    dispatch   `_dispatch`: pick an endpoint, its first event, retries (gateway/request/dispatch.py),
               down the model's fallback chain (gateway/request/fallback.py)
    respond    `_respond`: the whole answer, or
    stream     `_stream`: the dialect's events as they come
    settle     the request's `Settlement` (gateway/request/settlement.py): exactly once per
               admitted request, also on disconnect and failure; with a meter that has
               `settle_nowait`, queued, so the answer never waits for the usage write, except when
               the request counts against rate limits or a budget: then it settles before the
               answer goes out, so the caller's next request sees its real token count; a
               request sampled for the request log is queued with its record (gateway/request_logs/)

Errors before admission answer in the dialect's envelope and are never metered. After the stream
has started, a failure ends it with the dialect's error event (status 200 already sent).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from auth.cache_salt import cache_salt_for
from auth.principal import Authenticator, AuthError, Principal, Scope
from auth.settings import AuthSettings
from gateway.dialects.base import Dialect, StreamEncoder
from gateway.fleet.endpoints import Endpoint, Fleet, ModelRoute
from gateway.guardrails.base import GuardrailBlocked
from gateway.guardrails.chain import RequestGuards, build_chain
from gateway.metering.contract import (
    Admission,
    Meter,
    MeterBacklogged,
    RateLimited,
    ReservationTooLarge,
)
from gateway.request.cache_explainer import CacheExplainer, SessionTurn, session_of
from gateway.request.canonical import (
    FOLDED_EVENTS,
    Accumulator,
    CanonicalEvent,
    CanonicalRequest,
    PromptUsage,
    estimate_prompt_tokens,
)
from gateway.request.dispatch import Attempt, Timing
from gateway.request.errors import (
    BadRequest,
    GatewayError,
    ModelNotFound,
    PayloadTooLarge,
    UpstreamError,
    UpstreamThrottled,
    UpstreamTimeout,
)
from gateway.request.fallback import FallbackChains, FallbackObserver
from gateway.request.keeper import AnswerKeeper
from gateway.request.retention import RetentionPolicy, RetentionSettings
from gateway.request.settlement import Settlement
from gateway.request.usage import (
    COST_HEADER,
    STATUS_CLIENT_CLOSED,
    build_record,
    cost_usd_of,
    wants_cost,
)
from gateway.request.usage_tags import usage_session, usage_tags
from gateway.request_logs import RequestLog
from gateway.request_logs.capture import capture, keep_body
from gateway.routing.base import Router
from gateway.settings import GatewaySettings
from gateway.upstream.retry_budget import RetryBudget
from gateway.upstream.wait_timer import Watchdog
from gateway.web.credentials import (
    credential_of,  # one rule for every route: Bearer, else x-api-key
)
from infra.json_body import BodyError, read_json

log = logging.getLogger("aigw.gateway")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_CLIENT_GONE = (ConnectionResetError, ConnectionError)
_SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}
SERVED_MODEL_HEADER = "x-aigw-served-model"  # the model that answered (a fallback's, after a hop)


_ID_PREFIX = os.urandom(8).hex()  # per process: ids stay unique across workers and restarts
_id_counter = itertools.count()


def _client_request_id(request: web.Request) -> str | None:
    """The client's x-request-id if it is safe to echo."""
    given = request.headers.get("x-request-id")
    return given if given and _REQUEST_ID.match(given) else None


def _fresh_id() -> str:
    return f"{_ID_PREFIX}{next(_id_counter):08x}"  # (no syscall per id)


def new_request_id() -> str:
    """A fresh gateway request id (for an answer made before any request object exists)."""
    return _fresh_id()


def request_id_of(request: web.Request) -> str:
    """The client's x-request-id if it is safe to echo, else a fresh one."""
    return _client_request_id(request) or _fresh_id()


def request_ids_of(request: web.Request) -> tuple[str, str]:
    """(request id, usage record id). The record id is unique per gateway request: the meters
    settle once per record id, so a client-chosen x-request-id (which clients reuse, e.g. one per
    trace or a constant) gets a fresh suffix; '/' is outside the client ids' alphabet, so no
    client id can name another request's record."""
    given = _client_request_id(request)
    if given is None:
        fresh = _fresh_id()
        return fresh, fresh
    return given, f"{given}/{_fresh_id()}"


async def read_json_body(request: web.Request, max_body_bytes: int,
                         timeout_s: float | None = None) -> Any:
    """The request's JSON body; 413 over the cap, 408 when it does not arrive within
    `timeout_s`, 400 if it is not JSON (infra/json_body.py)."""
    try:
        return await read_json(request, max_body_bytes, timeout_s)
    except BodyError as exc:
        if exc.status == 413:
            raise PayloadTooLarge(exc.message) from exc
        if exc.status == 408:
            raise GatewayError(exc.message, status=408, code="request_timeout") from exc
        raise BadRequest(exc.message) from exc


# The gateway's own time on a request (ms), for the overhead metric; the `x-aigw-overhead-ms`
# header shows it only to a caller with the admin scope: its figure moves with what the request
# found cached or queued in state every tenant shares, a timing side channel for anyone else.
OVERHEAD_MS = web.ResponseKey("aigw_overhead_ms", float)


def error_response(dialect: Dialect, status: int, code: str, message: str, request_id: str,
                   overhead_ms: float, replica: str = "none",
                   headers: dict[str, str] | None = None, param: str | None = None,
                   error_type: str | None = None, show_overhead: bool = False) -> web.Response:
    body = dialect.error_body(status, code, message, param, error_type)
    response = web.Response(status=status, body=orjson.dumps(body),
                            content_type="application/json", headers=headers)
    _stamp(response, request_id, replica, overhead_ms, show_overhead)
    return response


def _stamp(response: web.StreamResponse, request_id: str, replica: str, overhead_ms: float,
           show_overhead: bool) -> None:
    """`show_overhead` is the operator's view (an admin caller, or auth off): only it reads the
    gateway's time and which endpoint served (`x-aigw-replica` is the endpoint's host:port,
    internal topology; others see it only as "none" when nothing was dispatched)."""
    response.headers["x-request-id"] = request_id
    if show_overhead or replica == "none":
        response.headers["x-aigw-replica"] = replica
    response[OVERHEAD_MS] = overhead_ms
    if show_overhead:
        response.headers["x-aigw-overhead-ms"] = f"{overhead_ms:.3f}"


def may_see_overhead(principal: Principal) -> bool:
    """Only an operator (the admin scope) reads the gateway's per-request timing (or anyone,
    with auth off: then the dashboard is open too)."""
    return Scope.ADMIN.value in principal.scopes


CacheSaltOf = Callable[[Principal], "str | None"]
ResponseStamp = Callable[[web.StreamResponse], None]  # extra headers on every answer we send


def default_cache_salt_of(principal: Principal) -> str | None:
    """auth's rule with its default scope: one prompt cache per project."""
    return cache_salt_for(principal, _DEFAULT_AUTH_SETTINGS)


_DEFAULT_AUTH_SETTINGS = AuthSettings()


class Pipeline:
    def __init__(self, settings: GatewaySettings, authenticator: Authenticator, meter: Meter,
                 router: Router, fleet: Fleet, cache_salt_of: CacheSaltOf = default_cache_salt_of,
                 stamp: ResponseStamp | None = None,
                 on_fallback: FallbackObserver | None = None,
                 on_cache_turn: Callable[[SessionTurn], None] | None = None) -> None:
        self.settings = settings
        self._extra_stamp = stamp  # telemetry's trace id header, when tracing is on
        self.cache_salt_of = cache_salt_of
        self.authenticator = authenticator
        self.meter = meter
        self.router = router
        self.fleet = fleet
        self.retry_budget = RetryBudget(settings.retry_budget_ratio, settings.num_retries_reserve)
        self.draining = False
        self._settle_nowait = getattr(meter, "settle_nowait", None)
        self._watchdog = Watchdog()  # the upstream waits' timeouts
        self._chains = FallbackChains(settings, fleet, self.retry_budget, self._watchdog,
                                      on_fallback)
        # each session's previous turn, to say where a prompt diverged (x-aigw-debug: 1, traces)
        self.cache_explainer = CacheExplainer(settings.cache_explainer_max_bytes)
        self._on_cache_turn = on_cache_turn  # telemetry: the turn into the request's trace
        self._counting: set[asyncio.Task[None]] = set()  # _count_and_settle tasks in flight
        # guardrails (gateway/guardrails/) and request logs (gateway/request_logs/; set by the
        # served app, whose store it is); None: off, nothing done per request
        self.guardrails = build_chain(settings, fleet, router, self.retry_budget, self._watchdog,
                                      meter)
        self.request_log: RequestLog | None = None
        self.retention = RetentionPolicy(RetentionSettings(
            settings.max_cache_retention_s, settings.session_cache_retention_s,
            settings.cache_retention_max_sessions))

    async def wait_settled(self, timeout_s: float = 5.0) -> None:
        """Shutdown, before the meter closes: let the settlements that count a prompt first
        (`_count_and_settle`, shielded from their cancelled handlers) finish."""
        if self._counting:
            await asyncio.wait(set(self._counting), timeout=timeout_s)

    def _count_then_settle(self, canonical: CanonicalRequest, route: ModelRoute,
                           outcome: _Outcome, admission: Admission, record: Callable[[], Any],
                           queue: bool = True) -> Awaitable[None]:
        """`_count_and_settle` as a task that shutdown waits for; the caller awaits it shielded
        (a client that leaves meanwhile stops neither the count nor the settlement)."""
        task = asyncio.ensure_future(self._count_and_settle(canonical, route, outcome, admission,
                                                            record, queue))
        self._counting.add(task)
        task.add_done_callback(self._counting.discard)
        return asyncio.shield(task)

    async def authorize(self, request: web.Request,
                        parse: Callable[[Any, str], CanonicalRequest], request_id: str
                        ) -> tuple[CanonicalRequest, Principal, ModelRoute]:
        """The checks every model route makes first: the credential (before the body), the invoke
        scope, the body cap, `parse` (the dialect's validation), the model exists and the key may
        call it. Raises AuthError or GatewayError."""
        principal = await self.authenticator.authenticate(credential_of(request))
        principal.require(Scope.INVOKE)
        body = await read_json_body(request, self.settings.max_body_bytes,
                                    self.settings.client_body_timeout_s)
        if self.request_log is not None:
            keep_body(request, body)  # (logged only if this request is sampled)
        canonical = parse(body, request_id)
        canonical.tags = usage_tags(body, request.headers)  # bounded: 400 past them
        principal.require_model(canonical.model)
        route = self.fleet.get(canonical.model)
        if route is None:
            raise ModelNotFound(f"the model {canonical.model!r} does not exist")
        return canonical, principal, route

    async def _admit(self, request: web.Request, dialect: Dialect, request_id: str,
                     usage_id: str, keeper: AnswerKeeper | None = None
                     ) -> tuple[CanonicalRequest, Principal, ModelRoute, Admission]:
        if self.draining:
            raise GatewayError("the gateway is shutting down", status=503, code="draining")
        canonical, principal, route = await self.authorize(request, dialect.parse, request_id)
        canonical.project = principal.project
        canonical.allowed_models = principal.allowed_models
        canonical.cache_salt = self.cache_salt_of(principal)
        canonical.session_id = request.headers.get("x-session-id")
        if keeper is not None:  # e.g. a stored conversation before the input (previous_response_id)
            await keeper.prepare(canonical, principal)
        canonical.usage_session = usage_session(canonical)
        canonical.kv_retention = self.retention.decide(canonical)
        canonical.service_tier = canonical.service_tier or self.settings.project_service_tiers.get(
            principal.project, self.settings.default_service_tier)
        max_tokens = canonical.max_tokens  # per choice; 0 (echo scoring a prompt) reserves none
        if max_tokens is None:
            max_tokens = self.settings.default_max_tokens
        context_length = route.context_length
        if context_length is not None and max_tokens > context_length:
            context_length = self._chains.context_length(route)  # a fallback's may be longer
        if context_length is not None and max_tokens > context_length:
            if canonical.max_tokens is not None:  # as the replica would refuse it, unadmitted
                raise BadRequest(
                    f"max_tokens ({max_tokens}) is over this model's context length of "
                    f"{context_length} tokens", param="max_tokens", code="context_length_exceeded")
            max_tokens = context_length  # the default reserve, on a small model
        num_prompt_tokens = await self._admission_prompt_tokens(canonical, route, principal)
        if canonical.rendered_prompt is not None:  # admission prices the cache: the expected hit
            num_prompt_tokens -= await self._expected_cached_tokens(canonical, route)
        try:
            admission = await self.meter.admit(usage_id, principal, canonical.model,
                                               num_prompt_tokens, canonical.num_choices * max_tokens)
        except ReservationTooLarge as exc:
            raise BadRequest(exc.message, param="max_tokens") from exc
        except MeterBacklogged as exc:  # back-pressure: the usage ledger cannot keep up
            raise GatewayError(exc.message, status=503, code="metering_backlogged") from exc
        return canonical, principal, route, admission

    async def _expected_cached_tokens(self, canonical: CanonicalRequest, route: ModelRoute) -> int:
        """The rendered prompt's tokens the prefix index expects the routed replica to hold: a
        token limit reserves only the uncached rest (settle charges the real figures), so agent
        turns that hit most of their prompt are not throttled as if they recomputed it."""
        try:
            return await self.router.expected_cached_tokens(canonical, route.endpoints)
        except Exception:  # noqa: BLE001 - an index outage: reserve the whole prompt
            log.debug("no cache estimate for %s", canonical.request_id, exc_info=True)
            return 0

    async def _admission_prompt_tokens(self, canonical: CanonicalRequest, route: ModelRoute,
                                       principal: Principal) -> int:
        """The prompt's tokens as admission counts them: exactly (the rendered prompt, chat
        template framing included, kept on the request for the prefix router to hash) when a
        token limit or budget applies and the backend renders like its upstream; with another
        upstream's configured tokenizer, its text tokens plus framing (at least the estimate);
        else the estimate. An estimate without the template's framing let 8 clients on two gateways pass
        a 3,000 tokens-a-minute limit by 135: admission saw each prompt ~20 tokens short."""
        render = getattr(route.backend, "render_prompt", None)
        counts_tokens = getattr(self.meter, "counts_tokens", None)
        estimate = estimate_prompt_tokens(canonical)
        if (not route.endpoints or counts_tokens is None or not counts_tokens(principal)):
            return estimate
        if render is None or canonical.num_prompts != 1 or canonical.kind == "embedding":
            if not route.settings.tokenizer:
                return estimate
            try:  # another upstream, with its tokenizer: text tokens + framing, at least the
                # estimate (its template is unknown here)
                counted = await asyncio.to_thread(route.backend.count_prompt_tokens, canonical,
                                                  route.endpoints[0])
            except Exception:  # noqa: BLE001 - the estimate stands
                return estimate
            return max(counted, estimate)
        try:  # (in a worker thread: the first call loads the tokenizer, a long prompt encodes)
            canonical.rendered_prompt = await asyncio.to_thread(render, canonical,
                                                                route.endpoints[0])
        except Exception:  # noqa: BLE001 - the upstream refuses it itself, in its own words
            log.debug("cannot render %s for admission", canonical.request_id, exc_info=True)
            return estimate
        assert canonical.rendered_prompt is not None  # render returns (text, ids)
        return len(canonical.rendered_prompt[1])

    async def handle(self, request: web.Request, dialect: Dialect,
                     keeper: AnswerKeeper | None = None) -> web.StreamResponse:
        """`keeper`: what a stateful API stores of its answers (gateway/request/keeper.py)."""
        timing = Timing(time.perf_counter())
        request_id, usage_id = request_ids_of(request)
        try:
            canonical, principal, route, admission = await self._admit(request, dialect, request_id,
                                                                       usage_id, keeper)
        except GatewayError as exc:
            return error_response(dialect, exc.status, exc.code, exc.message, request_id,
                                  timing.overhead_ms(), param=exc.param, error_type=exc.error_type)
        except AuthError as exc:
            return error_response(dialect, exc.status, exc.code, exc.message, request_id,
                                  timing.overhead_ms())
        except RateLimited as exc:
            return error_response(dialect, 429, "rate_limit_exceeded", exc.message, request_id,
                                  timing.overhead_ms(), headers=exc.headers)
        outcome = _Outcome(route)
        outcome.keeper = keeper

        def record() -> Any:
            latency_ms = (time.perf_counter() - timing.started) * 1000.0
            built = build_record(canonical, principal, outcome.route.settings,
                                 "" if outcome.replica == "none" else outcome.replica,
                                 outcome.accumulator, outcome.status, latency_ms,
                                 outcome.num_prompt_tokens, record_id=usage_id)
            if outcome.is_logged and self.request_log is not None:  # (queued, never awaited)
                self.request_log.submit(capture(
                    request, dialect, canonical, outcome.accumulator, outcome.error, built,
                    outcome.guards.body_masker() if outcome.guards is not None else None))
            return built

        async def settle_once(queue: bool) -> None:
            if outcome.needs_prompt_count():  # an answer that broke off before its usage
                await self._count_then_settle(canonical, outcome.route, outcome, admission,
                                              record, queue=queue)
            elif queue and self._settle_nowait is not None:
                self._settle_nowait(admission, record())  # never raises; nothing to cancel
            else:
                await asyncio.shield(self._settle(admission, record()))

        outcome.settlement = Settlement(settle_once)
        outcome.settles_before_answer = admission.counts_against_limits
        outcome.show_overhead = not self.settings.auth_enabled or may_see_overhead(principal)
        outcome.is_logged = self.request_log is not None and self.request_log.sample(
            principal.project)
        outcome.guards = (self.guardrails.for_request(canonical, principal) if self.guardrails
                          else None)
        try:
            if outcome.guards is not None:  # (a block is a 400, settled like any refusal)
                await outcome.guards.check_request(canonical)
            outcome.debug = request.headers.get("x-aigw-debug") == "1"
            outcome.explain_route = (request.headers.get("x-aigw-debug") == "1"
                                     and outcome.show_overhead)  # replicas' load: operators
            attempt = await self._dispatch(canonical, route, timing, outcome)
            if canonical.stream:
                return await self._stream(request, dialect, canonical, attempt, timing, outcome,
                                          admission.headers)
            return await self._respond(request, dialect, canonical, attempt, timing, outcome,
                                       admission.headers)
        except GatewayError as exc:
            outcome.status = exc.status
            outcome.error = (exc.code, exc.message)
            if isinstance(exc, UpstreamError) and exc.endpoint_name:
                outcome.replica = exc.endpoint_name  # the endpoint that answered with the error
                if exc.model_name != outcome.route.settings.name:  # a fallback's: bill it there
                    outcome.route = self.fleet.get(exc.model_name or "") or outcome.route
            if outcome.settles_before_answer:  # (an upstream refusal: its reservation is
                await outcome.settlement.settle(queue=False)  # released before the caller's next)
            headers = admission.headers
            if isinstance(exc, UpstreamThrottled):  # the upstream's retry-after, x-ratelimit-*
                headers = {**headers, **exc.headers}
            return error_response(dialect, exc.status, exc.code, exc.message, request_id,
                                  timing.overhead_ms(), outcome.replica, headers=headers,
                                  param=exc.param, error_type=exc.error_type,
                                  show_overhead=outcome.show_overhead)
        except asyncio.CancelledError:  # the client went away while we waited
            outcome.status = STATUS_CLIENT_CLOSED
            raise
        finally:
            await outcome.settlement.settle()  # (a no-op when settled before the answer)
            if outcome.turn is not None:
                self._settle_turn(canonical, outcome)

    async def _count_and_settle(self, canonical: CanonicalRequest, route: ModelRoute,
                                outcome: _Outcome, admission: Admission,
                                record: Callable[[], Any], queue: bool = True) -> None:
        """The upstream started answering but its usage never came (the client went away, or
        the stream broke): count the prompt it processed as the backend counts it (a replica:
        exactly, with its chat template and tokenizer; off the event loop), then settle
        (queued when `queue` and the meter can). If the count fails, the record keeps the
        estimate."""
        assert outcome.endpoint is not None
        try:
            outcome.num_prompt_tokens = await asyncio.to_thread(
                route.backend.count_prompt_tokens, canonical, outcome.endpoint)
        except Exception:  # noqa: BLE001 - e.g. a chat template that rejects this conversation
            log.debug("cannot count the prompt of %s", canonical.request_id, exc_info=True)
        if queue and self._settle_nowait is not None:
            self._settle_nowait(admission, record())
        else:
            await self._settle(admission, record())

    async def settle(self, admission: Admission, record: Any) -> None:
        """Settle now (for a route outside `handle`, e.g. count_tokens); never raises."""
        await self._settle(admission, record)

    async def _settle(self, admission: Admission, record: Any) -> None:
        try:
            await self.meter.settle(admission, record)
        except Exception:  # noqa: BLE001 - a metering outage must not fail the answer
            log.exception("settle failed for %s", record.request_id)

    async def _dispatch(self, canonical: CanonicalRequest, route: ModelRoute, timing: Timing,
                        outcome: _Outcome) -> Attempt:
        """An endpoint's first event, from the model or one down its fallback chain
        (gateway/request/fallback.py; routing and retries: gateway/request/dispatch.py). After a
        hop the answer names the model that served it, which the usage record bills."""
        attempt = await self._chains.dispatch(canonical, route, self.router, timing)
        outcome.replica, outcome.endpoint = attempt.endpoint.name, attempt.endpoint
        if attempt.route is not route:
            outcome.route = attempt.route
            canonical.model = attempt.route.settings.name
        if self.cache_explainer.max_bytes and session_of(canonical) is not None:
            self._explain_turn(canonical, attempt, outcome)
        return attempt

    def _explain_turn(self, canonical: CanonicalRequest, attempt: Attempt,
                      outcome: _Outcome) -> None:
        """This request as its session's next turn: where its prompt diverged from the previous
        turn's (gateway/request/cache_explainer.py), for the trace and the debug headers."""
        outcome.turn = self.cache_explainer.explain(canonical)
        if outcome.turn is not None and self._on_cache_turn is not None:
            self._on_cache_turn(outcome.turn)
        if isinstance(attempt.first_event, PromptUsage):  # a replica's stream announces it
            outcome.announced = attempt.first_event

    def _settle_turn(self, canonical: CanonicalRequest, outcome: _Outcome) -> None:
        """The turn's prompt and cached tokens, for the dashboard's session view."""
        usage = outcome.accumulator.usage or outcome.accumulator.prompt_usage
        session = session_of(canonical)
        if usage is not None and outcome.turn is not None and session is not None:
            self.cache_explainer.settle(outcome.turn, usage.prompt_tokens, usage.cached_tokens,
                                        canonical.project or "", session)

    async def _respond(self, request: web.Request, dialect: Dialect, canonical: CanonicalRequest,
                       attempt: Attempt, timing: Timing, outcome: _Outcome,
                       extra_headers: dict[str, str]) -> web.Response:
        """The whole answer, sent here (so settling and the telemetry that follow it are not on
        the client's critical path). Releases `attempt`."""
        outcome.status = 499  # until the answer is built (a cancelled handler keeps this)
        try:
            if outcome.guards is not None:  # the answer through the response guards
                await outcome.guards.guard_attempt(attempt, canonical)
            outcome.accumulator.add(attempt.first_event)
            await self._drain_events(attempt, outcome.accumulator, timing)
            attempt.endpoint.breaker.record_success()
        except GuardrailBlocked:
            attempt.endpoint.breaker.record_success()  # (the endpoint answered)
            raise
        except (UpstreamError, TimeoutError) as exc:
            attempt.endpoint.breaker.record_failure(time.monotonic())
            raise _after_start(exc, self.settings) from None
        finally:
            await attempt.release()
        outcome.status = 200
        if outcome.settles_before_answer:
            await outcome.settlement.settle(queue=False)
        answer = dialect.render(canonical, outcome.accumulator.response())
        if outcome.keeper is not None:
            await outcome.keeper.keep(canonical, answer)
        body = orjson.dumps(answer)
        response = web.Response(body=body, content_type="application/json", headers=extra_headers)
        _stamp(response, canonical.request_id, outcome.replica, timing.overhead_ms(),
               outcome.show_overhead)
        response.headers[SERVED_MODEL_HEADER] = canonical.model
        if wants_cost(request.headers):  # the client asked (x-aigw-cost: 1)
            response.headers[COST_HEADER] = cost_usd_of(canonical, outcome.route.settings,
                                                        outcome.accumulator)
        self._explain_route(response, canonical, outcome)
        if self._extra_stamp is not None:
            self._extra_stamp(response)
        try:
            await response.prepare(request)
            await response.write_eof()
        except _CLIENT_GONE:
            outcome.status = STATUS_CLIENT_CLOSED
        return response

    def _explain_route(self, response: web.StreamResponse, canonical: CanonicalRequest,
                       outcome: _Outcome) -> None:
        """`x-aigw-debug: 1` asks for the routing decision: matched blocks and scores per replica
        (for an admin caller: the scores show every replica's load)."""
        if outcome.debug:
            _explain_cache(response, outcome)
        if outcome.explain_route:
            response.headers["x-aigw-route"] = self.router.explain(canonical.request_id) or "no decision"

    async def _drain_events(self, attempt: Attempt, accumulator: Accumulator, timing: Timing) -> None:
        events = attempt.events
        perf_counter = time.perf_counter
        idle_timeout_s = self.settings.idle_timeout_s
        async with self._watchdog.timer() as timer:
            while True:
                waited = perf_counter()
                timer.waiting(idle_timeout_s)
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    break
                finally:
                    timer.done_waiting()
                    timing.upstream_s += perf_counter() - waited
                accumulator.add(event)

    async def _stream(self, request: web.Request, dialect: Dialect, canonical: CanonicalRequest,
                      attempt: Attempt, timing: Timing, outcome: _Outcome,
                      extra_headers: dict[str, str]) -> web.StreamResponse:
        """The answer as the dialect's events, written as they come. Releases `attempt`."""
        outcome.status = STATUS_CLIENT_CLOSED
        accumulator = outcome.accumulator
        encoder = dialect.encoder(canonical)
        response = web.StreamResponse(headers={**_SSE_HEADERS, **extra_headers})
        try:
            if outcome.guards is not None:  # (a block on the first event is still a 400)
                await outcome.guards.guard_attempt(attempt, canonical)
            _stamp(response, canonical.request_id, outcome.replica, timing.overhead_ms(),
                   outcome.show_overhead)
            response.headers[SERVED_MODEL_HEADER] = canonical.model
            self._explain_route(response, canonical, outcome)
            if self._extra_stamp is not None:
                self._extra_stamp(response)
            await response.prepare(request)
            outcome.status = 200
            accumulator.add(attempt.first_event)
            await response.write(encoder.start(accumulator.prompt_usage)
                                 + _delta_bytes(encoder, attempt.first_event))
            try:
                idle_timeout_s = self.settings.idle_timeout_s
                async with self._watchdog.timer() as timer:
                    while True:
                        timer.waiting(idle_timeout_s)
                        try:
                            event = await anext(attempt.events)
                        except StopAsyncIteration:
                            break
                        finally:
                            timer.done_waiting()
                        accumulator.add(event)
                        if not isinstance(event, FOLDED_EVENTS):
                            await response.write(encoder.event(event))
                attempt.endpoint.breaker.record_success()
                tail = encoder.finish(accumulator.response())
            except GuardrailBlocked as exc:  # a response guard stopped it: the dialect's error event
                attempt.endpoint.breaker.record_success()
                accumulator.finish_reason = "content_filter"
                outcome.error = (exc.code, exc.message)
                tail = encoder.error(exc.status, exc.code, exc.message)
            except (UpstreamError, TimeoutError) as exc:
                attempt.endpoint.breaker.record_failure(time.monotonic())
                error = _after_start(exc, self.settings)
                log.warning("stream %s failed after start: %s", canonical.request_id, error.message)
                accumulator.finish_reason = "error"
                tail = encoder.error(error.status, error.code, error.message)
            if outcome.keeper is not None and (answer := encoder.answer()) is not None:
                await outcome.keeper.keep(canonical, answer)  # before its last event goes out
            if outcome.settles_before_answer:
                await outcome.settlement.settle(queue=False)
            if wants_cost(request.headers):  # headers are gone: an SSE comment before the end
                tail = (f": {COST_HEADER}={cost_usd_of(canonical, outcome.route.settings, accumulator)}"
                        "\n\n").encode() + tail
            await response.write_eof(tail)  # the last events and the chunked terminator in one send
            return response
        except _CLIENT_GONE:
            outcome.status = STATUS_CLIENT_CLOSED  # the upstream is closed by release() below
            return response
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            outcome.status = STATUS_CLIENT_CLOSED
            raise
        finally:
            await attempt.release()


def _explain_cache(response: web.StreamResponse, outcome: _Outcome) -> None:
    """`x-aigw-debug: 1`: the prompt's tokens and how many hit the prefix cache (a stream: when
    its upstream announced them first, as our replicas do), and for a session where the prompt
    diverged from the previous turn's (docs/reference/api.md §4)."""
    usage = outcome.accumulator.usage or outcome.accumulator.prompt_usage or outcome.announced
    if usage is not None:
        response.headers["x-aigw-prompt-tokens"] = str(usage.prompt_tokens)
        response.headers["x-aigw-cache-hit-tokens"] = str(usage.cached_tokens)
    turn = outcome.turn
    if turn is not None:
        response.headers["x-aigw-cache-session-turn"] = str(turn.turn)
        divergence = turn.divergence
        if divergence is None:
            response.headers["x-aigw-cache-divergence"] = "none"
        else:
            response.headers["x-aigw-cache-divergence"] = divergence.where
            response.headers["x-aigw-cache-divergence-token"] = (
                str(divergence.token_index) if divergence.is_exact
                else f"~{divergence.token_index}")


def _delta_bytes(encoder: StreamEncoder, event: CanonicalEvent) -> bytes:
    return b"" if isinstance(event, FOLDED_EVENTS) else encoder.event(event)


def _after_start(exc: BaseException, settings: GatewaySettings) -> UpstreamError:
    if isinstance(exc, UpstreamError):
        return exc
    return UpstreamTimeout(f"the upstream sent nothing for {settings.idle_timeout_s:g}s")


class _Outcome:
    __slots__ = ("accumulator", "endpoint", "error", "explain_route", "guards", "is_logged",
                 "keeper", "num_prompt_tokens", "replica", "route", "settlement", "turn", "debug", "announced",
                 "settles_before_answer", "show_overhead", "status")

    def __init__(self, route: ModelRoute) -> None:
        self.route = route  # the model that serves: the requested one, or a fallback after a hop
        self.debug = False  # x-aigw-debug: 1
        self.turn: SessionTurn | None = None  # this request as its session's turn
        self.announced: PromptUsage | None = None  # a stream's first event: the prompt's usage
        self.accumulator = Accumulator()
        self.replica = "none"
        self.endpoint: Endpoint | None = None  # the endpoint that answered, once one did
        self.num_prompt_tokens: int | None = None  # counted here when the upstream sent no usage
        self.status = 502
        self.explain_route = False
        self.settlement: Settlement  # set once admitted: the one settle of this request
        self.settles_before_answer = False  # limited requests: settled before the answer goes out
        self.show_overhead = False  # x-aigw-overhead-ms: admin callers only
        self.keeper: AnswerKeeper | None = None  # stores the answer before it is sent
        self.guards: RequestGuards | None = None  # the guardrails that apply to this request
        self.is_logged = False  # sampled for the request log
        self.error: tuple[str, str] | None = None  # (code, message) answered, for the log

    def needs_prompt_count(self) -> bool:
        """An endpoint answered (so it processed the prompt) but no usage arrived, not even the
        prompt's count at its start."""
        return (self.endpoint is not None and self.accumulator.usage is None
                and self.accumulator.prompt_usage is None and self.accumulator.num_events > 0)
