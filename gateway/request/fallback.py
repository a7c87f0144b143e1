"""Fallback chains across models: when a model cannot answer, another configured model does.

    chains = FallbackChains(settings, fleet, budget, watchdog)
    attempt = await chains.dispatch(request, route, router, timing)  # attempt.route: who served

A model's chain is its `fallbacks`, each followed by its own fallbacks (depth first, every model
once): `a.fallbacks = ["b", "c"]`, `b.fallbacks = ["d"]` gives a -> b -> d -> c. Loops and
unknown targets are refused when the settings load (`fallback_chains`).

A hop is taken only before the first event reaches the client (`dispatch` returns with the first
event; a stream that breaks after it ends with the dialect's error event, never a fallback), and
only for failures another model may not share (`fallback_reason`):

    throttled          every endpoint tried answered 429 (a replica's latency_target refusal too)
    server_error       5xx, connection refused/reset, a malformed answer, an early end
    timeout            no first event within first_token_timeout_s / response_timeout_s
    breaker_open       no endpoint could be tried: their breakers are open
    no_healthy_endpoint  no endpoint could be tried: none is healthy
    context_length     the upstream refused the prompt as too long; only models whose context
                       is longer (or not known) are tried next

Any other refusal (a 400 for a bad field, a 4xx) ends the request: the next model would refuse
it too. Within each model, `dispatch` retries across endpoints as before; every hop spends one
retry from the shared `RetryBudget` (none left: the request ends with the error it has). When the
chain is exhausted the client gets the last upstream's error (a 429 with its Retry-After and
x-ratelimit-* headers); a model skipped for having no endpoint adds none over it. A model the
caller's key may not call (its `allowed_models`) is skipped: a fallback is no way around them.

Models of any backend kind chain with each other: the canonical request is backend-neutral, each
model's backend builds its own upstream body (its `upstream_model`, credential, cache salt).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Sequence

from gateway.fleet.endpoints import Fleet, ModelRoute
from gateway.request.canonical import CanonicalRequest
from gateway.request.dispatch import Attempt, Timing, dispatch
from gateway.request.errors import (
    GatewayError,
    NoHealthyEndpoint,
    UpstreamError,
    UpstreamRejected,
    UpstreamThrottled,
    UpstreamTimeout,
)
from gateway.routing.base import Router
from gateway.settings import GatewaySettings, ModelSettings
from gateway.upstream.retry_budget import RetryBudget
from gateway.upstream.wait_timer import Watchdog

FALLBACK_REASONS = ("throttled", "server_error", "timeout", "breaker_open", "no_healthy_endpoint",
                    "context_length")

# how upstreams say a prompt does not fit when they give no `context_length_exceeded` code:
# vLLM / OpenAI "maximum context length", Anthropic "prompt is too long", llama.cpp "context size"
_CONTEXT_WORDS = re.compile(r"maximum context length|context length|prompt is too long|"
                            r"context size|context window", re.IGNORECASE)


def fallback_chains(models: Sequence[ModelSettings]) -> dict[str, tuple[str, ...]]:
    """model name -> the models to try after it, in order (only models that have fallbacks).
    ValueError, one line, for a fallback that is not a configured model, one listed twice, or a
    loop (a model reachable from itself)."""
    by_name = {model.name: model for model in models}
    for model in models:
        for target in model.fallbacks:
            if target not in by_name:
                raise ValueError(f"model {model.name!r}: fallback {target!r} is not a configured "
                                 f"model")
        if len(set(model.fallbacks)) != len(model.fallbacks):
            raise ValueError(f"model {model.name!r}: a fallback is listed twice in "
                             f"{list(model.fallbacks)}")

    def walk(name: str, path: tuple[str, ...], order: dict[str, None]) -> None:
        for target in by_name[name].fallbacks:
            if target in path:
                loop = " -> ".join((*path[path.index(target):], target))
                raise ValueError(f"fallback loop: {loop}")
            if target not in order:
                order[target] = None
            walk(target, (*path, target), order)

    chains: dict[str, tuple[str, ...]] = {}
    for model in models:
        if model.fallbacks:
            order: dict[str, None] = {}
            walk(model.name, (model.name,), order)
            chains[model.name] = tuple(order)
    return chains


def is_context_length_error(error: GatewayError) -> bool:
    """An upstream's refusal of a prompt (plus max_tokens) too long for its context."""
    return error.code == "context_length_exceeded" or bool(_CONTEXT_WORDS.search(error.message))


def fallback_reason(error: GatewayError, route: ModelRoute) -> str | None:
    """Why `error` (what `route`'s model ended with) lets the chain go on; None: it ends here."""
    if isinstance(error, UpstreamThrottled):
        return "throttled"
    if isinstance(error, UpstreamTimeout):
        return "timeout"
    if isinstance(error, UpstreamRejected):
        return "context_length" if is_context_length_error(error) else None
    if isinstance(error, UpstreamError):
        return "server_error" if error.retryable else None
    if isinstance(error, NoHealthyEndpoint):
        now = time.monotonic()
        if any(e.is_healthy and not e.breaker.can_attempt(now) for e in route.endpoints):
            return "breaker_open"
        return "no_healthy_endpoint"
    return None


class FallbackChains:
    """Dispatch down a model's chain."""

    def __init__(self, settings: GatewaySettings, fleet: Fleet, budget: RetryBudget,
                 watchdog: Watchdog) -> None:
        self._settings = settings
        self._fleet = fleet
        self._budget = budget
        self._watchdog = watchdog
        self.chains = fallback_chains(settings.models)

    def context_length(self, route: ModelRoute) -> int | None:
        """The longest context any model of `route`'s chain reports (None: none known): what
        admission checks a max_tokens over `route`'s own against, since a model with a longer
        one down the chain may serve it."""
        chain = self.chains.get(route.settings.name)
        if not chain:
            return route.context_length
        lengths = [route.context_length, *(self._route(name).context_length for name in chain)]
        return max((length for length in lengths if length), default=None)

    def _route(self, name: str) -> ModelRoute:
        route = self._fleet.get(name)
        assert route is not None  # fallback_chains checked every target is a configured model
        return route

    def dispatch(self, request: CanonicalRequest, route: ModelRoute, router: Router,
                 timing: Timing) -> Awaitable[Attempt]:
        """The first event from `route`'s model, else from the first model down its chain that
        gives one; raises the error that ended the chain (module docstring). The first model is
        dispatched as if there were no chain: a chain costs nothing until its model fails, and a
        model without one is `dispatch()` itself (no coroutine layer of ours)."""
        chain = self.chains.get(route.settings.name)
        if not chain:
            return dispatch(request, route, router, self._settings, self._budget, timing,
                            self._watchdog)
        return self._dispatch_chained(request, route, router, chain, timing)

    async def _dispatch_chained(self, request: CanonicalRequest, route: ModelRoute,
                                router: Router, chain: tuple[str, ...], timing: Timing
                                ) -> Attempt:
        try:
            return await dispatch(request, route, router, self._settings, self._budget, timing,
                                  self._watchdog)
        except GatewayError as exc:
            return await self._fall_back(request, route, router, chain, exc, timing)

    async def _fall_back(self, request: CanonicalRequest, failed: ModelRoute, router: Router,
                         chain: tuple[str, ...], error: GatewayError, timing: Timing) -> Attempt:
        remaining = list(chain)
        current = failed
        answered: GatewayError | None = None  # the last error an upstream answered with
        refused_context = 0  # the longest context that refused this prompt as too long
        while True:
            if not isinstance(error, NoHealthyEndpoint):
                answered = error
            reason = fallback_reason(error, current)
            if reason == "context_length":
                refused_context = max(refused_context, current.context_length or 0)
            target = self._next(request, remaining, reason, refused_context)
            if reason is None or target is None or not self._budget.try_withdraw():
                raise (answered or error) from None
            request.observer.on_fallback(request, current.settings.name, target.settings.name,
                                         reason, error)
            current = target
            try:
                return await dispatch(request, current, router, self._settings, self._budget,
                                      timing, self._watchdog, deposit=False)
            except GatewayError as exc:
                error = exc

    def _next(self, request: CanonicalRequest, remaining: list[str], reason: str | None,
              refused_context: int) -> ModelRoute | None:
        """The next model to try (popped from `remaining`), or None: the chain ends."""
        if reason is None:
            return None
        now = time.monotonic()
        while remaining:
            target = self._route(remaining.pop(0))
            allowed = request.allowed_models
            if allowed is not None and target.settings.name not in allowed:
                continue  # the key may not call it: a fallback is no way around that
            if reason == "context_length" and 0 < (target.context_length or 0) <= refused_context:
                continue  # no longer than one that refused it
            if not any(endpoint.can_serve(now) for endpoint in target.endpoints):
                continue  # nothing to try there: no retry spent on it
            return target
        return None
