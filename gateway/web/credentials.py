"""The one credential rule of every route (admin, model, dashboard, traces)."""

from __future__ import annotations

from aiohttp import web


def credential_of(request: web.Request) -> str | None:
    """`Authorization: Bearer <token>`, else `x-api-key`; another Authorization scheme does not
    hide x-api-key."""
    authorization = request.headers.get("Authorization", "")
    if authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    return request.headers.get("x-api-key") or None
