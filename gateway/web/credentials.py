"""The one credential rule of every route (admin, model, dashboard, traces)."""

from __future__ import annotations

import time

from aiohttp import web

from auth.principal import Authenticator, AuthError, Principal
from gateway.request.observer import observer_of


def credential_of(request: web.Request) -> str | None:
    """`Authorization: Bearer <token>`, else `x-api-key`; another Authorization scheme does not
    hide x-api-key."""
    authorization = request.headers.get("Authorization", "")
    if authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    return request.headers.get("x-api-key") or None


async def authenticated(request: web.Request, authenticator: Authenticator) -> Principal:
    """The caller of a route that authenticates by itself (not through the model routes'
    admission), told to the request's observer as admission tells it: the trace's auth span
    and the access log's project and key id. Raises `authenticate`'s AuthError."""
    started_ns = time.time_ns()
    observer = observer_of(request)
    try:
        principal = await authenticator.authenticate(credential_of(request))
    except AuthError as exc:
        observer.on_authenticated(started_ns, None, exc.code)
        raise
    observer.on_authenticated(started_ns, principal, None)
    return principal
