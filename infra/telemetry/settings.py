"""Telemetry settings, from the environment (OpenTelemetry's own variables where one exists).

    AIGW_TRACING=0                       no spans at all (metrics stay on); so does
    OTEL_SDK_DISABLED=true               OpenTelemetry's own switch
    AIGW_TRACE_SAMPLE_RATIO=0.1          head sampling of new traces (parent-based: a sampled
                                         incoming `traceparent` is always kept)
    AIGW_TRACE_MAX_PER_S=100             at most this many new traces a second (per gateway
                                         process; 0 or inf: no limit); see
                                         gateway/telemetry/sampling.py
    AIGW_TRACE_BUFFER_TRACES=200         recent traces kept in memory for the dashboard
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT   also export over OTLP/HTTP (full URL, .../v1/traces)
    OTEL_EXPORTER_OTLP_ENDPOINT          the same, as a base URL (/v1/traces is appended)
    OTEL_SERVICE_NAME                    service.name (default: aigw-gateway / aigw-replica)
    AIGW_ACCESS_LOG=text                 the gateway's access log: text (default), json or off
                                         (gateway/telemetry/access_log.py)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

_FALSE = {"0", "false", "no", "off"}
N = TypeVar("N", int, float)


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    service_name: str = "aigw-gateway"
    is_tracing_enabled: bool = True
    sample_ratio: float = 1.0
    max_traces_per_s: float = 100.0  # new traces a second, after the ratio; 0 (or inf): no limit
    num_traces_buffered: int = 200
    num_spans_per_trace_max: int = 64
    otlp_traces_endpoint: str | None = None  # full URL of an OTLP/HTTP traces receiver
    access_log: str = "text"  # one line per request: "text", "json" or "off"

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError("AIGW_TRACE_SAMPLE_RATIO (sample_ratio) must be in [0, 1]")
        if not self.max_traces_per_s >= 0.0:  # (NaN too)
            raise ValueError("AIGW_TRACE_MAX_PER_S (max_traces_per_s) must be 0 (no limit) or more")
        if self.max_traces_per_s == math.inf:  # no limit, as 0 (a bucket of inf tokens turns NaN)
            object.__setattr__(self, "max_traces_per_s", 0.0)
        if self.num_traces_buffered < 1 or self.num_spans_per_trace_max < 1:
            raise ValueError("AIGW_TRACE_BUFFER_TRACES and spans per trace must be positive")
        if self.access_log not in ("text", "json", "off"):
            raise ValueError(f"AIGW_ACCESS_LOG={self.access_log!r}: expected text, json or off")

    @classmethod
    def from_env(cls, service_name: str = "aigw-gateway",
                 environ: Mapping[str, str] | None = None) -> TelemetrySettings:
        env = os.environ if environ is None else environ
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None
        if endpoint is None and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
        return cls(
            service_name=env.get("OTEL_SERVICE_NAME") or service_name,
            is_tracing_enabled=(env.get("AIGW_TRACING", "1").strip().lower() not in _FALSE
                                and env.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"),
            sample_ratio=_number(env, "AIGW_TRACE_SAMPLE_RATIO", "1.0", float),
            max_traces_per_s=_number(env, "AIGW_TRACE_MAX_PER_S", "100", float),
            num_traces_buffered=_number(env, "AIGW_TRACE_BUFFER_TRACES", "200", int),
            otlp_traces_endpoint=endpoint,
            access_log=env.get("AIGW_ACCESS_LOG", "text").strip().lower() or "text",
        )


def _number(env: Mapping[str, str], name: str, default: str, kind: Callable[[str], N]) -> N:
    """An environment variable as a number; a value that is not one names the variable."""
    text = env.get(name, default)
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None
