"""The dashboard's JSON, built from the gateway's own state (pure functions over it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gateway.fleet.endpoints import Fleet


def replica_rows(fleet: Fleet, cache_ratios: dict[str, float | None],
                 now: float) -> list[dict[str, Any]]:
    rows = []
    for route, endpoint in fleet.all_endpoints():
        load = endpoint.load
        kv_ratio = None
        if load is not None and load.num_kv_blocks_used is not None and load.num_kv_blocks_total:
            kv_ratio = load.num_kv_blocks_used / load.num_kv_blocks_total
        rows.append({
            "name": endpoint.name, "url": endpoint.url, "model": route.settings.name,
            "backend": route.settings.backend, "healthy": endpoint.is_healthy,
            "breaker": endpoint.breaker.state.value, "can_serve": endpoint.can_serve(now),
            "outstanding": endpoint.num_outstanding,
            "running": load.num_requests_running if load else None,
            "waiting": load.num_requests_waiting if load else None,
            "kv_blocks_used": load.num_kv_blocks_used if load else None,
            "kv_blocks_total": load.num_kv_blocks_total if load else None,
            "kv_usage": kv_ratio, "cache_hit_ratio": cache_ratios.get(endpoint.name)})
    return rows


def trace_summary(spans: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One line per trace for the list: its root span and the attributes worth a column."""
    if not spans:
        return None
    ids = {s["span_id"] for s in spans}
    root = next((s for s in spans if s["parent_span_id"] not in ids), spans[0])
    a = root["attributes"]
    return {"trace_id": root["trace_id"], "name": root["name"], "start_ns": root["start_ns"],
            "duration_ms": (root["end_ns"] - root["start_ns"]) / 1e6, "status": root["status"],
            "http_status": a.get("http.response.status_code"),
            # (a request refused before routing, e.g. 503 no_healthy_endpoint, has only the
            # settled record's model)
            "model": a.get("gen_ai.request.model") or a.get("gen_ai.response.model"),
            "project": a.get("aigw.project"), "replica": a.get("aigw.replica") or None,
            "input_tokens": a.get("gen_ai.usage.input_tokens"),
            "output_tokens": a.get("gen_ai.usage.output_tokens"),
            "cached_tokens": a.get("aigw.cached_tokens"), "num_spans": len(spans)}


def merge_spans(*groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """All spans once (by span id), ordered by start time."""
    seen: dict[str, dict[str, Any]] = {}
    for group in groups:
        for span in group:
            seen.setdefault(str(span.get("span_id")), span)
    return sorted(seen.values(), key=lambda s: s.get("start_ns", 0))


def replicas_in(spans: Iterable[dict[str, Any]]) -> set[str]:
    """Endpoint names (host:port) a trace's gateway spans went to."""
    return {str(s["attributes"]["aigw.replica"]) for s in spans
            if s.get("attributes", {}).get("aigw.replica")}
