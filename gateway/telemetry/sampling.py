"""TraceRateLimit: at most so many new traces a second, whatever the request rate.

Head sampling has two parts. The trace-id ratio (`AIGW_TRACE_SAMPLE_RATIO`) picks which new traces
to keep; this limit (`AIGW_TRACE_MAX_PER_S`) then bounds how many of those start each second, so
the cost of tracing (ids, the trace record, its place in the span buffer, an export) is bounded by
a rate rather than growing with the traffic. A quiet gateway, the one an operator is looking at,
traces every request; a saturated one traces a steady sample (at 1,000 requests a second and the
default 100, about one in ten), spread evenly over time. The dashboard keeps the last 200 traces in
any case. A caller's sampled `traceparent` is always continued and not counted here: the caller
made that decision (parent-based sampling, as the OpenTelemetry SDK's default).

Checked first, before any id is drawn, so a request over the limit costs a comparison (a new trace
the ratio then drops gives its token back). A token bucket: it holds up to `max(1, max_per_s)`
tokens, starts full and refills at `max_per_s`; each new trace takes one. Time is whatever monotonic
clock in seconds the caller passes (the middleware's `perf_counter` reading of the request's start).
Event loop only.
"""

from __future__ import annotations

import math


class TraceRateLimit:
    def __init__(self, max_per_s: float, now_s: float) -> None:
        if not 0 < max_per_s < math.inf:
            raise ValueError("max_per_s must be positive and finite (no limit: no TraceRateLimit)")
        self.max_per_s = max_per_s
        self._capacity = max(1.0, max_per_s)
        self._tokens = self._capacity
        self._updated_s = now_s

    def allow(self, now_s: float) -> bool:
        """Whether a new trace may start at `now_s` (taking its token if so)."""
        tokens = self._tokens + (now_s - self._updated_s) * self.max_per_s
        if tokens > self._capacity:
            tokens = self._capacity
        self._updated_s = now_s
        if tokens >= 1.0:
            self._tokens = tokens - 1.0
            return True
        self._tokens = tokens
        return False

    def refund(self) -> None:
        """Give back the token `allow` just took (the ratio then dropped that trace)."""
        self._tokens = min(self._capacity, self._tokens + 1.0)
