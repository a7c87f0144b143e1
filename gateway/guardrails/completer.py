"""`Complete` for guards: one non-streamed chat request to a model configured behind the gateway,
routed, retried and timed out as the pipeline does (gateway/request/dispatch.py), and metered to
the guarded request's caller: one usage record per call (`<request id>/guard-<n>`, the
classifier model's price, tagged `guardrail`), so a guard's tokens are billed like any other."""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any, cast

from gateway.fleet.endpoints import Fleet
from gateway.guardrails.base import Complete, GuardedRequest
from gateway.metering.contract import Admission, UsageRecord
from gateway.request.canonical import Accumulator, CanonicalRequest, Message, Role
from gateway.request.dispatch import Timing, dispatch
from gateway.request.errors import ModelNotFound
from gateway.request.observer import NULL_OBSERVER
from gateway.routing.base import Router
from gateway.settings import GatewaySettings
from gateway.upstream.retry_budget import RetryBudget
from gateway.upstream.wait_timer import Watchdog

log = logging.getLogger("aigw.guardrails")
_ids = itertools.count()
_PREFIX = "guard-" + os.urandom(4).hex()
GUARDRAIL_TAG = "guardrail"


def make_completer(fleet: Fleet, router: Router, settings: GatewaySettings, budget: RetryBudget,
                   watchdog: Watchdog, meter: Any = None) -> Complete:
    """`meter`: where the calls' usage goes (gateway/metering/meter.py; None: not metered)."""
    async def complete(model: str, turns: list[tuple[str, str]], max_tokens: int,
                       guarded: GuardedRequest) -> str:
        route = fleet.get(model)
        if route is None:
            raise ModelNotFound(f"the guardrail model {model!r} does not exist")
        request = CanonicalRequest(
            request_id=f"{_PREFIX}-{next(_ids):x}", model=model, max_tokens=max_tokens,
            temperature=0.0, cache_salt=guarded.cache_salt,
            observer=guarded.observer if guarded.observer is not None else NULL_OBSERVER,
            messages=[Message(role=cast(Role, role if role in ("system", "user", "assistant")
                                        else "user"), content=text) for role, text in turns])
        started = time.perf_counter()
        attempt = await dispatch(request, route, router, settings, budget, Timing(started),
                                 watchdog)
        accumulator = Accumulator()
        try:
            accumulator.add(attempt.first_event)
            async for event in attempt.events:
                accumulator.add(event)
        finally:
            await attempt.release()
        if meter is not None and guarded.principal is not None:
            await _meter(meter, guarded, attempt.route.settings.name, attempt.endpoint.name,
                         accumulator, (time.perf_counter() - started) * 1000)
        return accumulator.text
    return complete


async def _meter(meter: Any, guarded: GuardedRequest, model: str, endpoint: str,
                 accumulator: Accumulator, latency_ms: float) -> None:
    usage = accumulator.usage
    if usage is None:  # (an upstream that sent no usage: its prompt is not counted here)
        log.warning("guardrail classifier %s sent no usage; the call is not metered", model)
        return
    principal = guarded.principal
    record_id = f"{guarded.request_id or _PREFIX}/guard-{next(_ids):x}"
    cost = getattr(meter, "cost_usd", None)
    record = UsageRecord(
        record_id, principal.project, principal.key_id, model, endpoint, usage.prompt_tokens,
        usage.cached_tokens, usage.completion_tokens,
        cost(model, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        if cost is not None else 0.0, latency_ms, 200, time.time(),
        finish_reason=accumulator.finish_reason, tags=(GUARDRAIL_TAG,))
    try:
        await meter.settle(Admission(record_id, principal, model, 0), record)
    finally:
        if guarded.observer is not None:
            guarded.observer.on_usage(record)
