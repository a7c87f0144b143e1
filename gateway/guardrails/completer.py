"""`Complete` for guards: one non-streamed chat request to a model configured behind the gateway,
routed, retried and timed out as the pipeline does (gateway/request/dispatch.py)."""

from __future__ import annotations

import itertools
import os
import time
from typing import cast

from gateway.fleet.endpoints import Fleet
from gateway.guardrails.base import Complete
from gateway.request.canonical import Accumulator, CanonicalRequest, Message, Role
from gateway.request.dispatch import Timing, dispatch
from gateway.request.errors import ModelNotFound
from gateway.routing.base import Router
from gateway.settings import GatewaySettings
from gateway.upstream.retry_budget import RetryBudget
from gateway.upstream.wait_timer import Watchdog

_ids = itertools.count()
_PREFIX = "guard-" + os.urandom(4).hex()


def make_completer(fleet: Fleet, router: Router, settings: GatewaySettings, budget: RetryBudget,
                   watchdog: Watchdog) -> Complete:
    async def complete(model: str, turns: list[tuple[str, str]], max_tokens: int,
                       cache_salt: str | None) -> str:
        route = fleet.get(model)
        if route is None:
            raise ModelNotFound(f"the guardrail model {model!r} does not exist")
        request = CanonicalRequest(
            request_id=f"{_PREFIX}-{next(_ids):x}", model=model, max_tokens=max_tokens,
            temperature=0.0, cache_salt=cache_salt,
            messages=[Message(role=cast(Role, role if role in ("system", "user", "assistant")
                                        else "user"), content=text) for role, text in turns])
        attempt = await dispatch(request, route, router, settings, budget,
                                 Timing(time.perf_counter()), watchdog)
        accumulator = Accumulator()
        try:
            accumulator.add(attempt.first_event)
            async for event in attempt.events:
                accumulator.add(event)
        finally:
            await attempt.release()
        return accumulator.text
    return complete
