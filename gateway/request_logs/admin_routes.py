"""The request log part of the admin API (thin handlers over a RequestLog and its store).

    GET    /admin/v1/projects/{project}/request-logs          usage:read of that project (or admin)
           ?model=&trace_id=&request_id=&since=&until=&limit=&cursor=
           -> {"data": [entry, ...], "next_cursor": str | null}   newest first
    GET    /admin/v1/request-logs?trace_id=...                admin: a trace's entries, any project
    GET    /admin/v1/projects/{project}/request-log-settings  admin
    PUT    /admin/v1/projects/{project}/request-log-settings  admin  {"enabled", "sample_rate"}
    DELETE /admin/v1/projects/{project}/request-log-settings  admin  back to the config's

`since` / `until`: unix seconds or ISO 8601 (UTC unless it says otherwise). A settings change
reaches every gateway on the same store within `settings_refresh_s`. Errors are the admin API's
{"error": {"type": "admin_error", "code", "message"}}.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from auth.principal import Authenticator, AuthError, Principal, Scope
from gateway.request_logs.settings import ProjectLogSettings
from gateway.request_logs.store import MAX_PAGE, LogQuery
from gateway.request_logs.writer import RequestLog
from gateway.web.admin_routes import body_refusal, body_timeout_s
from gateway.web.credentials import authenticated
from infra.json_body import BodyError, read_json

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger("aigw.request_logs")
_MAX_FILTER_CHARS = 256


class _Invalid(Exception):
    pass


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": "admin_error", "code": code, "message": message}},
                             status=status)


def _time(value: str | None, name: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            raise _Invalid(f"{name}: unix seconds or an ISO 8601 time, not "
                           f"{value[:40]!r}") from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        seconds = parsed.timestamp()
    if not math.isfinite(seconds):
        raise _Invalid(f"{name}: not a finite time")
    return seconds


def _text(query: Any, name: str) -> str | None:
    value = query.get(name)
    if value is not None and (len(value) > _MAX_FILTER_CHARS or not value.isprintable()):
        raise _Invalid(f"{name}: at most {_MAX_FILTER_CHARS} printable characters")
    return value or None


def _project(request: web.Request) -> str:
    project = request.match_info["project"]
    try:
        project.encode()
    except UnicodeEncodeError:
        raise _Invalid("the project name is not UTF-8") from None
    return project


def build_request_log_routes(request_log: RequestLog, authenticator: Authenticator,
                             prefix: str = "/admin/v1") -> list[web.RouteDef]:
    store = request_log.store

    def guarded(scope: Scope, handler: Callable[[web.Request, Principal],
                                               Awaitable[web.StreamResponse]]) -> Handler:
        async def wrapper(request: web.Request) -> web.StreamResponse:
            try:
                principal = await authenticated(request, authenticator)
                principal.require(scope)
                return await handler(request, principal)
            except AuthError as exc:
                return _error(exc.status, exc.code, exc.message)
            except _Invalid as exc:
                return _error(400, "invalid_request", str(exc))
            except Exception:  # noqa: BLE001 - the store (Redis, the disk) did not answer
                log.warning("request log store failed for %s", request.path, exc_info=True)
                return _error(503, "store_unavailable", "the request log store did not answer")
        return wrapper

    def log_query(request: web.Request, project: str | None) -> LogQuery:
        query = request.query
        try:
            limit = int(query.get("limit", "50"))
        except ValueError:
            raise _Invalid("limit: a whole number") from None
        if not 1 <= limit <= MAX_PAGE:
            raise _Invalid(f"limit: 1 to {MAX_PAGE}")
        return LogQuery(project=project, model=_text(query, "model"),
                        trace_id=_text(query, "trace_id"), request_id=_text(query, "request_id"),
                        since=_time(query.get("since"), "since"),
                        until=_time(query.get("until"), "until"), limit=limit,
                        cursor=_text(query, "cursor"))

    async def respond(query: LogQuery) -> web.Response:
        await request_log.flush()  # (what this gateway has queued is readable at once)
        try:
            entries, cursor = await store.query(query)
        except ValueError as exc:
            raise _Invalid(str(exc)) from exc
        return web.json_response({"data": entries, "next_cursor": cursor})

    async def project_logs(request: web.Request, principal: Principal) -> web.Response:
        project = _project(request)
        principal.require_project(project)
        return await respond(log_query(request, project))

    async def trace_logs(request: web.Request, _: Principal) -> web.Response:
        query = log_query(request, None)
        if query.trace_id is None:
            raise _Invalid("trace_id is required (or read one project's logs)")
        return await respond(query)

    async def get_settings(request: web.Request, _: Principal) -> web.Response:
        await request_log.refresh_settings()
        return web.json_response(request_log.project_view(_project(request)))

    async def put_settings(request: web.Request, _: Principal) -> web.Response:
        project = _project(request)
        try:
            body = await read_json(request, 4096, body_timeout_s(request))
            # strict, as JSON types it: "yes" or 1 is not `true` (pydantic's lax mode took them)
            chosen = (ProjectLogSettings.model_validate_json(orjson.dumps(body), strict=True)
                      if isinstance(body, dict) else None)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                                 for e in exc.errors(include_url=False))
            raise _Invalid(f"the body must be {{\"enabled\": bool, \"sample_rate\": 0..1}}: "
                           f"{problems[:200]}") from None
        except BodyError as exc:
            if exc.status != 400:  # too large, an encoding not decoded here: as everywhere
                return body_refusal(exc)
            raise _Invalid(f"the body must be {{\"enabled\": bool, \"sample_rate\": 0..1}}: "
                           f"{str(exc)[:200]}") from None
        if chosen is None:
            raise _Invalid("the body must be a JSON object")
        await store.put_project_settings(project, chosen.model_dump())
        await request_log.refresh_settings()
        return web.json_response(request_log.project_view(project))

    async def delete_settings(request: web.Request, _: Principal) -> web.Response:
        project = _project(request)
        await store.put_project_settings(project, None)
        await request_log.refresh_settings()
        return web.json_response(request_log.project_view(project))

    admin = Scope.ADMIN
    settings_path = f"{prefix}/projects/{{project}}/request-log-settings"
    return [
        web.get(f"{prefix}/projects/{{project}}/request-logs",
                guarded(Scope.USAGE_READ, project_logs)),
        web.get(f"{prefix}/request-logs", guarded(admin, trace_logs)),
        web.get(settings_path, guarded(admin, get_settings)),
        web.put(settings_path, guarded(admin, put_settings)),
        web.delete(settings_path, guarded(admin, delete_settings)),
    ]
