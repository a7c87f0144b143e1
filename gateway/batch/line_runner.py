"""Running one batch line through the gateway's own request path, non-streamed:

    parse (the endpoint's dialect) -> the key may call the model -> meter.admit (the line's
    record id) -> dispatch (routing, retries, breakers: gateway/request/dispatch.py) -> drain ->
    render -> the output line, and the usage record it settles with (at the batch price)

`run_line` records nothing and settles nothing: the runner records the line's result first,
then settles it (gateway/batch/runner.py), so a crash between the two is mended on restart and
never counted twice (the record id is the line's, and meters settle once per record id).

A line that the upstream could not serve for a passing reason (no healthy endpoint, throttled,
a timeout, a rate limit of the caller's) is retried under the same admission, then answered as
the error it got; a line the request itself dooms (bad body, unknown model) is answered at once.
The gateway's guardrails check a line and its answer as they check an interactive request; a
model's fallback chain is not followed (a line that fails is retried on the same model).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import orjson

from auth.principal import AuthError, Principal
from gateway.dialects import OpenAIChat, OpenAICompletions
from gateway.dialects.base import Dialect
from gateway.dialects.openai_embeddings import OpenAIEmbeddings
from gateway.guardrails.base import GuardrailBlocked
from gateway.metering.contract import (
    Admission,
    MeterBacklogged,
    RateLimited,
    ReservationTooLarge,
    UsageRecord,
)
from gateway.request.canonical import (
    Accumulator,
    CanonicalRequest,
    Usage,
    estimate_prompt_tokens,
)
from gateway.request.dispatch import Timing, dispatch
from gateway.request.errors import (
    GatewayError,
    ModelNotFound,
    NoHealthyEndpoint,
    UpstreamAnswerTooLarge,
    UpstreamThrottled,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.request.pipeline import Pipeline
from gateway.request.usage import build_record
from gateway.upstream.wait_timer import Watchdog

NUM_ATTEMPTS = 3  # a line's tries through passing upstream failures
_PASSING = (NoHealthyEndpoint, UpstreamThrottled, UpstreamTimeout, UpstreamUnavailable)
_ADMIT_WAIT_MAX_S = 30.0  # a line over the caller's rate limit waits this long at most a try


def batch_dialects() -> dict[str, Dialect]:
    """The endpoints a batch may name, each with the dialect its lines are read in."""
    return {"/v1/chat/completions": OpenAIChat(), "/v1/completions": OpenAICompletions(),
            "/v1/embeddings": OpenAIEmbeddings()}


def line_request_id(batch_id: str, index: int) -> str:
    """The line's usage record id (and its `request_id`): the same on every try and restart."""
    return f"{batch_id}/{index}"


def line_output_id(batch_id: str, index: int) -> str:
    return ("batch_req_"
            + hashlib.blake2b(f"{batch_id}/{index}".encode(), digest_size=12).hexdigest())


@dataclass(frozen=True)
class LineOutcome:
    ok: bool
    output: bytes  # the output (ok) or error file's line, newline included
    record: UsageRecord | None  # None: nothing was admitted (nothing to meter)
    admission: Admission | None = None


def output_line(batch_id: str, index: int, custom_id: str | None, status: int | None,
                body: Any, error: dict[str, str] | None = None) -> bytes:
    response = None if status is None else {
        "status_code": status, "request_id": line_request_id(batch_id, index), "body": body}
    return orjson.dumps({"id": line_output_id(batch_id, index), "custom_id": custom_id,
                         "response": response, "error": error}) + b"\n"


class LineRunner:
    def __init__(self, pipeline: Pipeline, price_discount: float) -> None:
        self._pipeline = pipeline
        self._price_factor = 1.0 - price_discount
        self._watchdog = Watchdog()
        self._dialects = batch_dialects()
        self._num_held: dict[str, int] = {}  # model -> attempts this runner holds open

    def num_held(self, model: str) -> int:
        """The model's upstream attempts held by batch lines now (each counted in its endpoint's
        `num_outstanding` from when dispatch returned it until it is released: while dispatch is
        still choosing, a line counts as interactive, which errs towards waiting)."""
        return self._num_held.get(model, 0)

    def dialect_for(self, endpoint: str) -> Dialect | None:
        return self._dialects.get(endpoint)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._dialects)

    async def run_line(self, batch_id: str, index: int, custom_id: str, endpoint: str,
                       body: dict[str, Any], principal: Principal) -> LineOutcome:
        dialect = self._dialects[endpoint]
        request_id = line_request_id(batch_id, index)
        try:
            principal = await self._current(principal)
            canonical, route = self._parse(dialect, body, principal, request_id)
            admission = await self._admit(canonical, principal)
        except GatewayError as exc:
            return self._refused(dialect, batch_id, index, custom_id, exc.status, exc.code,
                                 exc.message, exc.param)
        except AuthError as exc:
            return self._refused(dialect, batch_id, index, custom_id, exc.status, exc.code,
                                 exc.message, None)
        return await self._serve(dialect, batch_id, index, custom_id, canonical, route,
                                 principal, admission)

    async def _current(self, principal: Principal) -> Principal:
        """The creating key's rights now: a key revoked (or expired) since the batch was created
        runs none of its remaining lines (each is its 401), a key whose models were narrowed
        runs them with the narrower set. JWT callers keep the rights their token had."""
        current = getattr(self._pipeline.authenticator, "current_principal", None)
        if principal.via != "api_key" or current is None:
            return principal
        return await current(principal.key_id)  # type: ignore[no-any-return]

    def _parse(self, dialect: Dialect, body: dict[str, Any], principal: Principal,
               request_id: str) -> tuple[CanonicalRequest, Any]:
        canonical = dialect.parse(body, request_id)
        canonical.stream = False
        canonical.observer = self._pipeline.background_observer  # (counted, never traced)
        canonical.service_tier = "flex"  # batch lines yield to interactive requests on our replicas
        principal.require_model(canonical.model)
        route = self._pipeline.fleet.get(canonical.model)
        if route is None:
            raise ModelNotFound.named(canonical.model)
        canonical.project = principal.project
        canonical.allowed_models = principal.allowed_models
        canonical.cache_salt = self._pipeline.cache_salt_of(principal)
        return canonical, route

    async def _admit(self, canonical: CanonicalRequest, principal: Principal) -> Admission:
        max_tokens = canonical.max_tokens
        if max_tokens is None:
            max_tokens = self._pipeline.settings.default_max_tokens
        canonical.admitted_tokens = (estimate_prompt_tokens(canonical), max_tokens)
        while True:  # a batch line waits out the caller's rate limit rather than failing
            try:
                return await self._pipeline.meter.admit(
                    canonical.request_id, principal, canonical.model, *canonical.admitted_tokens)
            except RateLimited as exc:
                await asyncio.sleep(min(max(exc.retry_after_s, 0.1), _ADMIT_WAIT_MAX_S))
            except MeterBacklogged:
                await asyncio.sleep(1.0)
            except ReservationTooLarge as exc:
                raise GatewayError(exc.message, status=400, code="invalid_request") from None

    def _refused(self, dialect: Dialect, batch_id: str, index: int, custom_id: str, status: int,
                 code: str, message: str, param: str | None) -> LineOutcome:
        body = dialect.error_body(status, code, message, param)
        return LineOutcome(False, output_line(batch_id, index, custom_id, status, body), None)

    async def _serve(self, dialect: Dialect, batch_id: str, index: int, custom_id: str,
                     canonical: CanonicalRequest, route: Any, principal: Principal,
                     admission: Admission) -> LineOutcome:
        pipeline = self._pipeline
        started = time.perf_counter()
        accumulator, endpoint_name, status = Accumulator(), "", 502
        error: GatewayError | None = None
        chain = getattr(pipeline, "guardrails", None)  # the interactive requests' guardrails
        guards = chain.for_request(canonical, principal) if chain is not None else None
        if guards is not None:
            try:
                await guards.check_request(canonical)
            except GatewayError as exc:  # blocked: refused as the endpoint would refuse it
                record = self._record(canonical, principal, route, "", accumulator, exc.status,
                                      started, admission)
                body = dialect.error_body(exc.status, exc.code, exc.message, exc.param,
                                          exc.error_type)
                return LineOutcome(False, output_line(batch_id, index, custom_id, exc.status,
                                                      body), record, admission)
        pipeline.retry_budget.on_request()
        for attempt_number in range(NUM_ATTEMPTS):
            accumulator, error = Accumulator(), None
            try:
                attempt = await dispatch(canonical, route, pipeline.router, pipeline.settings,
                                         pipeline.retry_budget, Timing(started), self._watchdog)
            except GatewayError as exc:
                error, status = exc, exc.status
                if isinstance(exc, UpstreamAnswerTooLarge):  # computed, unread: not run again,
                    endpoint_name = exc.endpoint_name or ""  # billed as admitted (as a request)
                    accumulator.add(Usage(*canonical.admitted_tokens))
                    accumulator.finish_reason = "error"
                    break
                if isinstance(exc, _PASSING) and attempt_number + 1 < NUM_ATTEMPTS:
                    await asyncio.sleep(pipeline.settings.health_interval_s * (attempt_number + 1))
                    continue
                break
            endpoint_name = attempt.endpoint.name
            self._num_held[canonical.model] = self._num_held.get(canonical.model, 0) + 1
            try:
                if guards is not None:  # the answer through the response guards
                    await guards.guard_attempt(attempt, canonical)
                accumulator.add(attempt.first_event)
                async with asyncio.timeout(pipeline.settings.response_timeout_s):
                    async for event in attempt.events:
                        accumulator.add(event)
                attempt.endpoint.breaker.record_success()
                status = 200
            except (GatewayError, TimeoutError) as exc:
                if isinstance(exc, GuardrailBlocked):  # (the endpoint answered)
                    attempt.endpoint.breaker.record_success()
                else:
                    attempt.endpoint.breaker.record_failure(time.monotonic())
                error = exc if isinstance(exc, GatewayError) else UpstreamTimeout(
                    f"{endpoint_name} did not finish within "
                    f"{pipeline.settings.response_timeout_s:g}s")
                status = error.status
            finally:
                await attempt.release()
                self._num_held[canonical.model] -= 1
            break
        record = self._record(canonical, principal, route, endpoint_name, accumulator, status,
                              started, admission)
        if error is not None:
            body = dialect.error_body(error.status, error.code, error.message, error.param,
                                      error.error_type)
            return LineOutcome(False, output_line(batch_id, index, custom_id, status, body), record,
                               admission)
        rendered = dialect.render(canonical, accumulator.response())
        return LineOutcome(True, output_line(batch_id, index, custom_id, 200, rendered), record,
                           admission)

    def _record(self, canonical: CanonicalRequest, principal: Principal, route: Any,
                endpoint_name: str, accumulator: Accumulator, status: int, started: float,
                admission: Admission) -> UsageRecord:
        latency_ms = (time.perf_counter() - started) * 1000.0
        record = build_record(canonical, principal, route.settings, endpoint_name, accumulator,
                              status, latency_ms, record_id=admission.request_id)
        return dataclasses.replace(record, cost_usd=record.cost_usd * self._price_factor)
