"""Endpoint picking. `create_router(name, settings)` builds a `Router` (gateway/routing/base.py).

Routers: "least_outstanding"; "prefix" (prefix_router.py: KV-aware, index in Redis when
`settings.redis_url` is set, else in process); "auto" = "prefix" when some model served by our
replicas has at least two endpoints, else "least_outstanding". Heavy imports stay lazy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.routing.base import Decision, LeastOutstandingRouter, Router

if TYPE_CHECKING:
    from gateway.settings import GatewaySettings

__all__ = ["Decision", "LeastOutstandingRouter", "Router", "create_router", "ROUTER_NAMES"]

ROUTER_NAMES = ("least_outstanding", "prefix", "auto")


def create_router(name: str, settings: GatewaySettings | None = None) -> Router:
    if name == "auto":
        use_prefix = settings is not None and any(
            m.backend == "replica" and len(m.endpoints) >= 2 for m in settings.models)
        name = "prefix" if use_prefix else "least_outstanding"
    if name == "least_outstanding":
        return LeastOutstandingRouter()
    if name == "prefix":
        from gateway.routing.prefix_router import PrefixRouter, PrefixRouterConfig

        if settings is None:
            return PrefixRouter(PrefixRouterConfig())
        return PrefixRouter(PrefixRouterConfig(
            redis_url=settings.redis_url,
            segment_cache_max_bytes=settings.prompt_segment_cache_max_bytes))
    raise ValueError(f"unknown router {name!r} (known: {', '.join(ROUTER_NAMES)})")
