"""GET /dashboard (the page, no credential needed: it shows nothing until one is given) and its
JSON API, every call of which needs an admin credential (Scope.ADMIN; with auth disabled the
gateway is open and so is the API):

    GET /dashboard/api/overview            replicas, latency percentiles, usage series, recent
                                           traces, per-class TTFT/TPOT against the targets (slo)
    GET /dashboard/api/traces/{trace_id}   one trace: gateway spans merged with the replicas' spans

The page keeps the key in sessionStorage and sends it as `Authorization: Bearer ...`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

from auth.principal import AuthError, Scope
from gateway.dashboard import STATIC_DIR
from gateway.dashboard.replicas import cache_hit_ratio_of, replica_metrics, replica_spans
from gateway.dashboard.slo import slo_rows
from gateway.dashboard.views import merge_spans, replica_rows, replicas_in, trace_summary
from gateway.fleet.endpoints import Endpoint, ModelRoute
from gateway.telemetry.keys import TELEMETRY
from gateway.web.credentials import credential_of
from gateway.web.keys import AUTHENTICATOR, FLEET, METER, SETTINGS, SLO_RATES, TRANSPORT
from infra.telemetry.settings import TelemetrySettings

REPLICA_TIMEOUT_S = 1.0
NUM_TRACES_LISTED = 30
_USAGE_DAYS_GROUP = ("day",)


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json",
                        headers={"cache-control": "no-store"})


async def _require_admin(request: web.Request) -> web.Response | None:
    """None if the caller may read the dashboard, else the error answer."""
    if not request.app[SETTINGS].auth_enabled:
        return None
    try:
        principal = await request.app[AUTHENTICATOR].authenticate(credential_of(request))
        principal.require(Scope.ADMIN)
    except AuthError as exc:
        return _json({"error": {"code": exc.code, "message": exc.message}}, exc.status)
    return None


async def page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"cache-control": "no-store"})


async def overview(request: web.Request) -> web.Response:
    denied = await _require_admin(request)
    if denied is not None:
        return denied
    app = request.app
    telemetry, fleet = app[TELEMETRY], app[FLEET]
    replica_endpoints = [(route, e) for route, e in fleet.all_endpoints()
                         if route.settings.backend == "replica"]
    texts = await asyncio.gather(*(replica_metrics(app[TRANSPORT], e, REPLICA_TIMEOUT_S)
                                   for _, e in replica_endpoints))
    ratios = [cache_hit_ratio_of(text) for text in texts]
    usage = telemetry.usage.to_json()
    projects = list(usage["projects"])  # type: ignore[call-overload]
    traces = [summary for spans in telemetry.spans.recent(NUM_TRACES_LISTED)
              if (summary := trace_summary(spans)) is not None]
    return _json({
        "now": time.time(),
        "replicas": replica_rows(fleet, dict(zip([e.name for _, e in replica_endpoints], ratios,
                                                 strict=True)), time.monotonic()),
        "slo": slo_rows(_by_model(replica_endpoints, texts), app[SLO_RATES], time.monotonic()),
        "latency": telemetry.latency.percentiles(),
        "usage": usage,
        "usage_daily": await _usage_daily(app, projects),
        "traces": traces,
        "tracing": _tracing_json(telemetry.settings),
    })


def _by_model(endpoints: list[tuple[ModelRoute, Endpoint]], texts: list[str | None]
              ) -> list[tuple[str, float | None, float | None, list[str]]]:
    """(model, its configured TTFT / TPOT targets, its replicas' /metrics texts)."""
    models: dict[str, tuple[str, float | None, float | None, list[str]]] = {}
    for (route, _), text in zip(endpoints, texts, strict=True):
        settings = route.settings
        entry = models.setdefault(settings.name, (settings.name, settings.ttft_p90_ms,
                                                  settings.tpot_p90_ms, []))
        if text is not None:
            entry[3].append(text)
    return list(models.values())


def _tracing_json(settings: TelemetrySettings) -> dict[str, object]:
    """Which requests get a trace (the traces table's caption)."""
    return {"enabled": settings.is_tracing_enabled, "sample_ratio": settings.sample_ratio,
            "max_new_per_s": settings.max_traces_per_s or None,  # None: no limit
            "num_traces_buffered": settings.num_traces_buffered}


async def _usage_daily(app: web.Application,
                       projects: list[str]) -> dict[str, list[dict[str, object]]]:
    """Per project, per UTC day, from metering's read side (empty when metering keeps none)."""
    meter = app[METER]
    read = getattr(meter, "usage_by_project", None)
    if read is None:
        return {}
    result = {}
    for project in projects:
        try:
            rows = await read(project, _USAGE_DAYS_GROUP)
        except Exception:  # noqa: BLE001 - a metering outage must not blank the dashboard
            continue
        result[project] = [row.to_json_dict() for row in rows]
    return result


async def trace(request: web.Request) -> web.Response:
    denied = await _require_admin(request)
    if denied is not None:
        return denied
    app = request.app
    trace_id = request.match_info["trace_id"].lower()
    gateway_spans = app[TELEMETRY].spans.trace(trace_id)
    names = replicas_in(gateway_spans)
    endpoints = [e for _, e in app[FLEET].all_endpoints() if e.name in names]
    remote = await replica_spans(app[TRANSPORT], endpoints, trace_id, REPLICA_TIMEOUT_S)
    return _json({"trace_id": trace_id, "spans": merge_spans(gateway_spans, remote)})
