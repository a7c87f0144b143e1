"""GET /metrics: the gateway's Prometheus text.

Series labelled with a `project` (requests, tokens, cost and the cache hit ratio per project)
tell one tenant about every other, so they are served only to a caller with a credential for
them; everyone else gets the same families with the `project` label summed away:

    settings.metrics_public or auth off      every series, to anyone
    Authorization: Bearer <metrics_token>    every series (the Prometheus scrape's bearer token)
    an API key or JWT with the admin scope   every series
    no credential                            series summed over projects
    another credential                       401 (a scrape misconfigured is loud, not blind)
"""

from __future__ import annotations

import hmac

from aiohttp import web

from auth.principal import AuthError, Scope
from gateway.telemetry.keys import TELEMETRY
from gateway.telemetry.metrics import CONTENT_TYPE
from gateway.web.credentials import credential_of
from gateway.web.keys import AUTHENTICATOR, SETTINGS


async def metrics(request: web.Request) -> web.Response:
    try:
        per_project = await _may_read_per_project(request)
    except AuthError as exc:
        return web.json_response({"error": {"code": exc.code, "message": exc.message}},
                                 status=exc.status)
    return web.Response(body=request.app[TELEMETRY].metrics.render(per_project),
                        headers={"Content-Type": CONTENT_TYPE})


async def _may_read_per_project(request: web.Request) -> bool:
    settings = request.app[SETTINGS]
    if settings.metrics_public or not settings.auth_enabled:
        return True
    credential = credential_of(request)
    if credential is None:
        return False
    token = settings.metrics_token
    if token and hmac.compare_digest(credential.encode("utf-8", "surrogateescape"),
                                     token.encode("utf-8", "surrogateescape")):
        return True
    principal = await request.app[AUTHENTICATOR].authenticate(credential)
    if Scope.ADMIN.value not in principal.scopes:
        raise AuthError(403, "insufficient_scope",
                        "per-project metrics need the metrics token or an admin credential")
    return True
