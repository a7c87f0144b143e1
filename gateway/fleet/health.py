"""Active health checks: every `health_interval_s`, ask each endpoint's backend for health, load
and (once) its context length. Passive ejection lives in each endpoint's circuit breaker."""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.fleet.endpoints import Endpoint, Fleet, ModelRoute

log = logging.getLogger("aigw.gateway.health")


# An endpoint is taken out after this many failed checks in a row (one slow answer from a busy
# replica is not an outage; real failures also trip the circuit breaker on the request path at
# once), and back in after one good check.
UNHEALTHY_AFTER_FAILED_CHECKS = 2


async def check_endpoint(route: ModelRoute, endpoint: Endpoint) -> None:
    ok = await route.backend.health(endpoint)
    endpoint.num_failed_checks = 0 if ok else endpoint.num_failed_checks + 1
    healthy = (ok
               or (endpoint.is_healthy
                   and endpoint.num_failed_checks < UNHEALTHY_AFTER_FAILED_CHECKS))
    if healthy != endpoint.is_healthy:
        log.warning("endpoint %s is now %s", endpoint.url, "healthy" if healthy else "unhealthy")
    endpoint.is_healthy = healthy
    if not ok:
        return
    endpoint.load = await route.backend.load(endpoint)
    if endpoint.context_length is None:
        endpoint.context_length = await route.backend.context_length(endpoint)


async def check_fleet(fleet: Fleet) -> None:
    await asyncio.gather(*(check_endpoint(route, endpoint)
                           for route, endpoint in fleet.all_endpoints()))
    fleet.note_servable(time.monotonic())  # what /health's grace (`unready_after_s`) counts from


async def run_health_checks(fleet: Fleet, interval_s: float) -> None:
    """Forever, a round every `interval_s` (the first round is the caller's); cancel to stop."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await check_fleet(fleet)
        except Exception:  # noqa: BLE001 - a checker bug must not stop checking
            log.exception("health check round failed")
