"""Telemetry set-up shared by the gateway and the replica: settings from the environment
(settings), the lean tracer provider (lean_tracer, tracing), the in-memory span buffer the
dashboard reads (span_buffer) and the span attribute names (attributes)."""
