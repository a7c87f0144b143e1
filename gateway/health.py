"""Active health checks: every `health_interval_s`, ask each endpoint's backend for health, load
and (once) its context length. Passive ejection lives in each endpoint's circuit breaker."""

from __future__ import annotations

import asyncio
import logging

from gateway.endpoints import Endpoint, Fleet, ModelRoute

log = logging.getLogger("aigw.gateway.health")


async def check_endpoint(route: ModelRoute, endpoint: Endpoint) -> None:
    healthy = await route.backend.health(endpoint)
    if healthy != endpoint.is_healthy:
        log.warning("endpoint %s is now %s", endpoint.url, "healthy" if healthy else "unhealthy")
    endpoint.is_healthy = healthy
    if not healthy:
        return
    endpoint.load = await route.backend.load(endpoint)
    if endpoint.context_length is None:
        endpoint.context_length = await route.backend.context_length(endpoint)


async def check_fleet(fleet: Fleet) -> None:
    await asyncio.gather(*(check_endpoint(route, endpoint)
                           for route, endpoint in fleet.all_endpoints()))


async def run_health_checks(fleet: Fleet, interval_s: float) -> None:
    """Forever, a round every `interval_s` (the first round is the caller's); cancel to stop."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await check_fleet(fleet)
        except Exception:  # noqa: BLE001 - a checker bug must not stop checking
            log.exception("health check round failed")
