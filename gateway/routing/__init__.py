"""Endpoint picking. `create_router(name)` builds a `Router` (gateway/routing/base.py)."""

from __future__ import annotations

from gateway.routing.base import Decision, LeastOutstandingRouter, Router

__all__ = ["Decision", "LeastOutstandingRouter", "Router", "create_router"]


def create_router(name: str) -> Router:
    if name == "least_outstanding":
        return LeastOutstandingRouter()
    raise ValueError(f"unknown router {name!r} (known: least_outstanding)")
