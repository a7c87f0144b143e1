"""The admin HTTP API (aiohttp): projects, keys and usage. Thin handlers over auth/'s KeyAdmin
(auth/ is the domain: no HTTP).

    app.add_routes(build_admin_routes(services, "/admin/v1"))   # services: auth.AuthServices

    GET    /admin/v1/projects                        admin   list projects
    POST   /admin/v1/projects        {name}          admin   create a project
    GET    /admin/v1/projects/{project}/keys         admin   list keys (no secrets, no hashes)
    POST   /admin/v1/projects/{project}/keys         admin   create: {scopes, name?, models?,
                                                             expires_in?} -> the key, once
    GET    /admin/v1/keys/{key_id}                   admin   one key
    DELETE /admin/v1/keys/{key_id}                   admin   revoke (also POST .../revoke)
    POST   /admin/v1/keys/{key_id}/rotate            admin   {grace_seconds} -> the new key, once
    GET    /admin/v1/projects/{project}/usage        usage:read of that project (or admin);
                                                     ?group_by=day,hour,model,key,tag,session (any
                                                     of them)&since=&until=&key_id=&tag=
                                                     &format=json|csv

The credential comes from `Authorization: Bearer ...` or `x-api-key`. Errors are JSON
{"error": {"type", "code", "message"}} with 400/401/403/404/409; a body is refused as the
gateway's routes refuse one (`body_refusal`): 413 over its bound, 415 for a Content-Encoding the
gateway does not decode, 400 when it is not JSON or not what its Content-Encoding says.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from auth.key_admin import InvalidRequest
from auth.principal import AuthError, Principal, Scope
from auth.store import ProjectExists, UnknownKey, UnknownProject
from gateway.web.credentials import authenticated
from gateway.web.keys import SETTINGS
from gateway.web.origin_check import cross_site_write
from infra.json_body import BodyError, read_json

if TYPE_CHECKING:
    from auth import AuthServices

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": "admin_error", "code": code, "message": message}},
                             status=status)


def _project_in_path(request: web.Request) -> str:
    """The path's project name; UnknownProject for one no store could hold (a byte that is not
    UTF-8 arrives as a lone surrogate, which neither SQLite nor Redis can encode)."""
    project = request.match_info["project"]
    try:
        project.encode()
    except UnicodeEncodeError:
        raise UnknownProject(project.encode("utf-8", "backslashreplace").decode()) from None
    return project


MAX_ADMIN_BODY_BYTES = 64 * 1024  # a project name, a key's scopes and models
_BODY_CODES = {408: "request_timeout", 413: "payload_too_large", 415: "unsupported_media_type"}


def body_refusal(exc: BodyError) -> web.Response:
    """A body infra/json_body.read_json refused, in the admin envelope with the status the rest of
    the gateway answers it with: 413, 415, 408, else 400 `invalid_request`."""
    return _error(exc.status, _BODY_CODES.get(exc.status, "invalid_request"), exc.message)


def body_timeout_s(request: web.Request) -> float | None:
    """The gateway's client_body_timeout_s (None in an app without GatewaySettings)."""
    settings = request.app.get(SETTINGS)
    return None if settings is None else settings.client_body_timeout_s


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object a request carries ({} for none); BodyError for one read_json refused
    (too large, slower than the gateway's client_body_timeout_s, an encoding not decoded here,
    not JSON, too deep, a number beyond a double)."""
    body = ((await read_json(request, MAX_ADMIN_BODY_BYTES, body_timeout_s(request)))
            if request.can_read_body else {})
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    return body


def build_admin_routes(services: AuthServices, prefix: str = "/admin/v1",
                       usage_reader: Any | None = None) -> list[web.RouteDef]:
    """aiohttp routes of the admin API, authenticated by `services.authenticator`.

    `usage_reader` (a gateway.metering UsageReader) defaults to one on the same store, opened on
    the first usage request and closed with `services`."""
    if usage_reader is not None:
        services.usage_reader = usage_reader
    admin = services.admin
    reader_lock = asyncio.Lock()

    def guarded(scope: Scope, handler: Callable[[web.Request, Principal],
                                               Awaitable[web.StreamResponse]]) -> Handler:
        async def wrapper(request: web.Request) -> web.StreamResponse:
            refused = cross_site_write(request)  # the dashboard's writes: CSRF-safe
            if refused is not None:
                return _error(403, "cross_site_request", refused)
            try:
                principal = await authenticated(request, services.authenticator)
                principal.require(scope)
                return await handler(request, principal)
            except AuthError as exc:
                return _error(exc.status, exc.code, exc.message)
            except InvalidRequest as exc:
                return _error(400, "invalid_request", str(exc))
            except BodyError as exc:
                return body_refusal(exc)
            except ProjectExists as exc:
                return _error(409, "project_exists", f"project {exc} already exists")
            except UnknownProject as exc:
                return _error(404, "unknown_project", f"no project {exc}")
            except UnknownKey as exc:
                return _error(404, "unknown_key", f"no key {exc}")
        return wrapper

    async def list_projects(request: web.Request, _: Principal) -> web.Response:
        projects = await services.store.list_projects()
        return web.json_response({"data": [{"name": p.name, "created_at": p.created_at}
                                           for p in projects]})

    async def create_project(request: web.Request, _: Principal) -> web.Response:
        name = (await _body(request)).get("name")
        if not isinstance(name, str):
            raise InvalidRequest("'name' is required")
        project = await admin.create_project(name)
        return web.json_response({"name": project.name, "created_at": project.created_at},
                                 status=201)

    async def list_keys(request: web.Request, _: Principal) -> web.Response:
        project = _project_in_path(request)
        if await services.store.get_project(project) is None:
            raise UnknownProject(project)
        keys = await services.store.list_keys(project)
        return web.json_response({"data": [k.public_view() for k in keys]})

    async def create_key(request: web.Request, _: Principal) -> web.Response:
        body = await _body(request)
        scopes, models, expires_in = body.get("scopes"), body.get("models"), body.get("expires_in")
        if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
            raise InvalidRequest("'scopes' must be a list of scope names")
        if models is not None and not (isinstance(models, list)
                                       and all(isinstance(m, str) for m in models)):
            raise InvalidRequest("'models' must be a list of model names")
        name = body.get("name", "")
        if not isinstance(name, str):
            raise InvalidRequest("'name' must be a string")
        record, secret = await admin.create_key(
            _project_in_path(request), scopes, name=name,
            allowed_models=models, expires_in_s=expires_in)
        return web.json_response({**record.public_view(), "key": secret}, status=201)

    async def get_key(request: web.Request, _: Principal) -> web.Response:
        return web.json_response((await admin.get_key(request.match_info["key_id"])).public_view())

    async def revoke_key(request: web.Request, _: Principal) -> web.Response:
        record = await admin.revoke_key(request.match_info["key_id"])
        services.forget_cached_key(record.key_id)  # refused here from the next request on
        return web.json_response(record.public_view())

    async def rotate_key(request: web.Request, _: Principal) -> web.Response:
        grace = (await _body(request)).get("grace_seconds", 0)
        record, secret = await admin.rotate_key(request.match_info["key_id"], grace)
        services.forget_cached_key(record.key_id)
        return web.json_response({**record.public_view(), "key": secret})

    async def project_usage(request: web.Request, principal: Principal) -> web.Response:
        from gateway.metering import open_usage_reader, render_csv, render_json
        from gateway.metering.usage_report import validate_day

        project = _project_in_path(request)
        principal.require_project(project)
        query = request.query
        try:
            since = validate_day(query.get("since"), "since")
            until = validate_day(query.get("until"), "until")
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        output_format = query.get("format", "json")
        if output_format not in ("json", "csv"):
            raise InvalidRequest(f"format must be json or csv, not {output_format!r}")
        group_by = [g.strip() for g in query.get("group_by", "model,day").split(",") if g.strip()]
        async with reader_lock:
            if services.usage_reader is None:
                services.usage_reader = await open_usage_reader(services.redis,
                                                                services.settings.data_dir)
        try:
            rows = await services.usage_reader.usage_by_project(
                project, group_by, since=since, until=until, key_id=query.get("key_id"),
                tag=query.get("tag"))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        if not rows and await services.store.get_project(project) is None:
            raise UnknownProject(project)  # a typo; a project known only from JWTs has usage
        if output_format == "csv":
            return web.Response(text=render_csv(rows, group_by), content_type="text/csv",
                                headers={"content-disposition":
                                         f'attachment; filename="usage-{project}.csv"'})
        return web.json_response(text=render_json(project, rows, group_by))

    admin_scope = Scope.ADMIN
    return [
        web.get(f"{prefix}/projects", guarded(admin_scope, list_projects)),
        web.post(f"{prefix}/projects", guarded(admin_scope, create_project)),
        web.get(f"{prefix}/projects/{{project}}/keys", guarded(admin_scope, list_keys)),
        web.post(f"{prefix}/projects/{{project}}/keys", guarded(admin_scope, create_key)),
        web.get(f"{prefix}/projects/{{project}}/usage", guarded(Scope.USAGE_READ, project_usage)),
        web.get(f"{prefix}/keys/{{key_id}}", guarded(admin_scope, get_key)),
        web.delete(f"{prefix}/keys/{{key_id}}", guarded(admin_scope, revoke_key)),
        web.post(f"{prefix}/keys/{{key_id}}/revoke", guarded(admin_scope, revoke_key)),
        web.post(f"{prefix}/keys/{{key_id}}/rotate", guarded(admin_scope, rotate_key)),
    ]
