"""The admin API's limits and budgets: thin handlers over gateway/metering/limit_store.py.

    app.add_routes(build_limit_routes(auth_services, limits, "/admin/v1"))

    GET    /admin/v1/projects/{project}/limits   admin  {project, stored, effective, source, keys}
    PUT    /admin/v1/projects/{project}/limits   admin  body: Limits -> the stored record
    DELETE /admin/v1/projects/{project}/limits   admin  back to the config file's limits
    GET    /admin/v1/keys/{key_id}/limits        admin  the same for one key
    PUT    /admin/v1/keys/{key_id}/limits        admin
    DELETE /admin/v1/keys/{key_id}/limits        admin

A PUT replaces the scope's whole record (a field left out is no limit). The body is metering's
`Limits` (requests_per_minute, tokens_per_minute, max_concurrent_requests, daily_budget_usd,
budgets [{usd, window, window_s?, starts_at?, alert_at?}], webhook_url + webhook_secret);
the secret is write-only (answers show `webhook_secret_set`). This instance applies a change
before answering; the others within a second (gateway/metering/limit_watcher.py).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import ValidationError

from auth.key_admin import InvalidRequest
from auth.principal import AuthError, Principal, Scope
from auth.store import UnknownKey, UnknownProject
from gateway.metering.limit_store import LimitScope, LimitStore
from gateway.metering.limit_watcher import LimitWatcher
from gateway.metering.settings import Limits
from gateway.web.admin_routes import _body, _error, _project_in_path, body_refusal
from gateway.web.credentials import authenticated
from gateway.web.origin_check import cross_site_write
from infra.json_body import BodyError

if TYPE_CHECKING:
    from auth import AuthServices

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class LimitServices:
    store: LimitStore
    watcher: LimitWatcher
    meter: Any  # gateway.metering.BaseMeter: limits_for_project/limits_for_key, the effective ones


def validation_message(exc: ValidationError) -> str:
    """One line per problem: 'budgets.0.window_s: Input should be ...'."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                     for e in exc.errors(include_url=False))[:2000]


def parse_limits(body: Any) -> Limits:
    """A limits body as JSON types it, without coercion: `true` is not 1 request a minute and
    `"10"` not a number (pydantic's lax mode took both). ValidationError when it is not one;
    ValueError for a NaN or infinity (which `aigw limits set --json` could parse)."""
    return Limits.model_validate_json(json.dumps(body, allow_nan=False), strict=True)


def build_limit_routes(services: AuthServices, limits: LimitServices,
                       prefix: str = "/admin/v1") -> list[web.RouteDef]:
    def guarded(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Handler:
        async def wrapper(request: web.Request) -> web.StreamResponse:
            refused = cross_site_write(request)
            if refused is not None:
                return _error(403, "cross_site_request", refused)
            try:
                principal: Principal = await authenticated(request, services.authenticator)
                principal.require(Scope.ADMIN)
                return await handler(request)
            except AuthError as exc:
                return _error(exc.status, exc.code, exc.message)
            except InvalidRequest as exc:
                return _error(400, "invalid_request", str(exc))
            except BodyError as exc:
                return body_refusal(exc)
            except ValidationError as exc:
                return _error(400, "invalid_limits", validation_message(exc))
            except UnknownProject as exc:
                return _error(404, "unknown_project", f"no project {exc}")
            except UnknownKey as exc:
                return _error(404, "unknown_key", f"no key {exc}")
        return wrapper

    async def scope_of(request: web.Request) -> LimitScope:
        if "key_id" in request.match_info:
            record = await services.admin.get_key(request.match_info["key_id"])
            return LimitScope(record.project, key_id=record.key_id)
        project = _project_in_path(request)
        if await services.store.get_project(project) is None:
            raise UnknownProject(project)
        return LimitScope(project)

    def view(scope: LimitScope) -> dict[str, Any]:
        stored = limits.meter.stored_limits.get(scope)  # what this instance applies
        effective: Limits = (limits.meter.limits_for_project(scope.project) if scope.key_id is None
                             else limits.meter.limits_for_key(scope.key_id))
        body: dict[str, Any] = {
            "project": scope.project, "key_id": scope.key_id,
            "source": "api" if stored is not None else "config",
            "stored": None if stored is None else stored.public_view(),
            "effective": effective.public_view()}
        if scope.key_id is None:
            body["keys"] = {
                key_id: v.public_view()
                for key_id, v in limits.meter.stored_limits.of_project(scope.project).items()}
        return body

    async def get_limits(request: web.Request) -> web.Response:
        """What this instance applies now (a change made elsewhere shows within a second)."""
        return web.json_response(view(await scope_of(request)))

    async def put_limits(request: web.Request) -> web.Response:
        scope = await scope_of(request)
        record = parse_limits(await _body(request))
        await limits.store.put(scope, record)
        await limits.watcher.reload()  # in force here before the answer
        return web.json_response(view(scope))

    async def delete_limits(request: web.Request) -> web.Response:
        scope = await scope_of(request)
        deleted = await limits.store.delete(scope)
        await limits.watcher.reload()
        return web.json_response({**view(scope), "deleted": deleted})

    routes = []
    for path in (f"{prefix}/projects/{{project}}/limits", f"{prefix}/keys/{{key_id}}/limits"):
        routes += [web.get(path, guarded(get_limits)), web.put(path, guarded(put_limits)),
                   web.delete(path, guarded(delete_limits))]
    return routes
