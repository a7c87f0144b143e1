"""Observability for the gateway: traces (OpenTelemetry, an in-memory buffer always, OTLP/HTTP
when configured), Prometheus metrics, and the series the ops dashboard (gateway/dashboard/) reads.

    from gateway.telemetry import Telemetry
    from infra.telemetry.settings import TelemetrySettings
"""

from gateway.telemetry.middleware import TRACE_ID_HEADER
from gateway.telemetry.telemetry import Telemetry

__all__ = ["TRACE_ID_HEADER", "Telemetry"]
