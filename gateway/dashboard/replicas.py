"""What the dashboard asks the replicas: /metrics (prefix-cache counters here, the latency-target
series in gateway/dashboard/slo.py), and a trace's spans
from /debug/traces (each replica keeps its own span buffer: engine/server/tracing.py).

All fetches are bounded by `timeout_s` and never raise: an unreachable replica yields nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import orjson

from gateway.fleet.endpoints import Endpoint
from gateway.upstream.transport import PROBE_BODY_MAX_BYTES, Transport, UpstreamRequest

_CACHE_COUNTERS = ("prefix_cache_hit_tokens_total", "prefix_cache_queried_tokens_total")


async def fetch(transport: Transport, url: str, timeout_s: float,
                headers: dict[str, str] | None = None) -> bytes | None:
    try:
        async with asyncio.timeout(timeout_s):
            response = await transport.send(UpstreamRequest("GET", url, headers=dict(headers or {}),
                                                            connect_timeout_s=timeout_s))
            try:
                return (await response.read(PROBE_BODY_MAX_BYTES) if response.status == 200
                        else None)
            finally:
                response.close()
    except Exception:  # noqa: BLE001 - the dashboard shows what it can
        return None


def parse_cache_counters(metrics_text: str) -> dict[str, float]:
    """Sum the replica's prefix-cache counters (any metric name ending in the known suffixes)."""
    totals = dict.fromkeys(_CACHE_COUNTERS, 0.0)
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        for suffix in _CACHE_COUNTERS:
            if name.endswith(suffix):
                try:
                    totals[suffix] += float(value)
                except ValueError:
                    pass
    return totals


MAX_METRICS_BYTES = 4 * 1024 * 1024  # a replica's /metrics is ~20 KiB; more is not read


async def replica_metrics(transport: Transport, endpoint: Endpoint, timeout_s: float) -> str | None:
    """The replica's /metrics text (None: unreachable, or over MAX_METRICS_BYTES)."""
    body = await fetch(transport, endpoint.url + "/metrics", timeout_s, endpoint.auth_headers)
    if body is None or len(body) > MAX_METRICS_BYTES:
        return None
    return body.decode("utf-8", "replace")


def cache_hit_ratio_of(metrics_text: str | None) -> float | None:
    if metrics_text is None:
        return None
    totals = parse_cache_counters(metrics_text)
    queried = totals["prefix_cache_queried_tokens_total"]
    return totals["prefix_cache_hit_tokens_total"] / queried if queried else None


async def replica_spans(transport: Transport, endpoints: Sequence[Endpoint], trace_id: str,
                        timeout_s: float) -> list[dict[str, Any]]:
    bodies = await asyncio.gather(*(
        fetch(transport, f"{e.url}/debug/traces?trace_id={quote(trace_id)}", timeout_s,
              e.auth_headers)
        for e in endpoints))
    spans: list[dict[str, Any]] = []
    for body in bodies:
        if body is None:
            continue
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            continue
        found = payload.get("spans") if isinstance(payload, dict) else None
        spans.extend(s for s in found or () if isinstance(s, dict))
    return spans
