"""Getting a first event: pick an endpoint, start the backend stream, retry before the first token.

    attempt = await dispatch(...)      # Attempt(route, endpoint, events, first_event), or raises
    try: ... read attempt.events ...
    finally: await attempt.release()   # exactly once: closes the upstream, frees the slot

Retries happen only before the first event, only for retryable `UpstreamError`s, at most
`settings.num_retries` per request and within the shared `RetryBudget`; each retry goes to an
endpoint not yet tried for this request. Each failure but a throttle (429) feeds the endpoint's
circuit breaker. The request's observer (`request.observer`) is told each routing decision and a
stream's first event. Each call deposits its request in the budget (`RetryBudget.on_request`) unless
`deposit` is false: a fallback chain's later models (gateway/request/fallback.py) are the same
request.

A replica's admission refusal (`UpstreamOverloaded`, 429 `latency_target`: its predicted queueing
would break the request's TTFT target) is retried on the next-best endpoint once at most, then
raised with the replica's Retry-After; each refusal is told to the request's observer
(`on_refused`: whether another endpoint is tried after it). The refused attempt held no engine slot
and produced no usage: only its `num_outstanding` is given back, as for any failure before the first
event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.fleet.endpoints import Endpoint, ModelRoute
from gateway.request.canonical import CanonicalEvent, CanonicalRequest
from gateway.request.errors import (
    NoHealthyEndpoint,
    UpstreamError,
    UpstreamOverloaded,
    UpstreamThrottled,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.routing.base import Router
from gateway.settings import GatewaySettings
from gateway.upstream.retry_budget import RetryBudget
from gateway.upstream.wait_timer import WaitTimer, Watchdog

MAX_LATENCY_REFUSALS = 2  # the chosen endpoint and the next-best one


@dataclass(slots=True)
class Timing:
    """Where a request's time went; `upstream_s` is time spent awaiting the backend.
    `abandoned_at`: the model and endpoint whose first event the request was awaiting when it
    was cancelled (its client left), which therefore had the request; None otherwise."""

    started: float
    upstream_s: float = 0.0
    abandoned_at: tuple[ModelRoute, Endpoint] | None = None

    def overhead_ms(self) -> float:
        return max(0.0, (time.perf_counter() - self.started - self.upstream_s) * 1000.0)


@dataclass(slots=True)
class Attempt:
    route: ModelRoute  # the model that answered (a fallback's, after a hop)
    endpoint: Endpoint
    events: AsyncIterator[CanonicalEvent]
    first_event: CanonicalEvent
    _released: bool = False

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.endpoint.num_outstanding -= 1
        await _close(self.events)


async def _close(events: AsyncIterator[CanonicalEvent]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


def _as_upstream_error(exc: BaseException, endpoint: Endpoint, request: CanonicalRequest,
                       timeout_s: float) -> UpstreamError:
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, TimeoutError):
        what = "no first token" if request.stream else "no answer"
        return UpstreamTimeout(f"{endpoint.name} sent {what} within {timeout_s:g}s")
    return UpstreamUnavailable(f"{endpoint.name} ended the stream before any event")


def _any_untried(route: ModelRoute, tried: set[int]) -> bool:
    now = time.monotonic()
    return any(id(e) not in tried and e.can_serve(now) for e in route.endpoints)


def first_event_timeout_s(request: CanonicalRequest, settings: GatewaySettings) -> float:
    """How long the first event may take: a stream's first token, or a non-streamed request's
    whole answer (its first event comes with the upstream's whole body)."""
    return settings.first_token_timeout_s if request.stream else settings.response_timeout_s


async def dispatch(request: CanonicalRequest, route: ModelRoute, router: Router,
                   settings: GatewaySettings, budget: RetryBudget, timing: Timing,
                   watchdog: Watchdog, deposit: bool = True) -> Attempt:
    if deposit:
        budget.on_request()
    tried: set[int] = set()
    last_error: UpstreamError | None = None
    num_retries = 0
    num_refusals = 0  # latency-target refusals (UpstreamOverloaded)
    while True:
        now = time.monotonic()
        candidates = [e for e in route.endpoints if id(e) not in tried and e.can_serve(now)]
        if not candidates:
            if last_error is not None:
                raise last_error
            raise NoHealthyEndpoint(f"no healthy endpoint for model {request.model!r}")
        routing_started_ns = time.time_ns()
        decision = await router.choose(request, candidates)
        request.observer.on_routed(request, candidates, decision, routing_started_ns, router)
        endpoint = decision.endpoint
        endpoint.breaker.on_attempt(now)
        endpoint.num_outstanding += 1
        events = route.backend.stream(request, endpoint)
        wait_started = time.perf_counter()
        timeout_s = first_event_timeout_s(request, settings)
        try:
            async with WaitTimer(watchdog) as timer:
                timer.waiting(timeout_s)
                first = await anext(events)
            timing.upstream_s += time.perf_counter() - wait_started
            if request.stream:
                request.observer.on_first_token()
            return Attempt(route, endpoint, events, first)
        except (UpstreamError, TimeoutError, StopAsyncIteration) as exc:
            timing.upstream_s += time.perf_counter() - wait_started
            endpoint.num_outstanding -= 1
            await _close(events)
            error = _as_upstream_error(exc, endpoint, request, timeout_s)
            error.endpoint_name = endpoint.name
            error.model_name = route.settings.name
            tried.add(id(endpoint))
            last_error = error
            if not error.retryable:
                endpoint.breaker.record_success()  # the endpoint answered; the request was at fault
                raise error from None
            if not isinstance(error, UpstreamThrottled):  # (a throttled endpoint is healthy)
                endpoint.breaker.record_failure(time.monotonic())
            overloaded = isinstance(error, UpstreamOverloaded)
            num_refusals += overloaded
            if (num_retries >= settings.num_retries or num_refusals >= MAX_LATENCY_REFUSALS
                    or not _any_untried(route, tried)
                    or not budget.try_withdraw()):  # (no retry spent when none could be made)
                if overloaded:
                    request.observer.on_refused(request, route.settings.name, False)
                raise error from None
            if overloaded:
                request.observer.on_refused(request, route.settings.name, True)
            num_retries += 1
        except BaseException as exc:
            endpoint.num_outstanding -= 1
            if isinstance(exc, asyncio.CancelledError):  # the client left while it waited
                timing.abandoned_at = (route, endpoint)
            await _close(events)
            raise
