"""TracingTransport: wraps the gateway's Transport so each upstream call of a traced request gets
a CLIENT span (send -> close, so a stream's span lasts as long as the stream) and carries the
W3C `traceparent` of that span, which the replica continues. It also notes when the first body
line arrived (time to first token, for streams), through `lines` or `line_batches`, whichever the
backend reads; both forward to the wrapped response unchanged. Calls made outside a request
(health checks, the dashboard's own fetches) pass straight through. Built with `tracer=None`
(tracing off) it creates no spans and only notes the first line's time.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.telemetry.attributes import AIGW_REPLICA
from gateway.telemetry.observation import RequestObservation, current_observation
from gateway.transport import Transport, UpstreamRequest, UpstreamResponse

PROPAGATOR: TextMapPropagator = TraceContextTextMapPropagator()


@lru_cache(maxsize=1024)
def _span_shape(method: str, url: str) -> tuple[str, dict[str, Any]]:
    """(span name, attributes) of a call; a gateway calls few distinct URLs, so each is parsed once."""
    parts = urlsplit(url)
    return (f"upstream {method} {parts.path}",
            {"http.request.method": method, "url.full": url, "server.address": parts.hostname or "",
             "server.port": parts.port or 0, AIGW_REPLICA: parts.netloc})


class TracingTransport(Transport):
    def __init__(self, inner: Transport, tracer: Tracer | None) -> None:
        self.inner = inner
        self._tracer = tracer

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        observation = current_observation()
        if observation is None:
            return await self.inner.send(request)
        if self._tracer is None or observation.span is None:
            return _TracedResponse(await self.inner.send(request), None, observation)
        name, attributes = _span_shape(request.method, request.url)
        span = self._tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
        recording = span.is_recording()
        if recording:  # (not sampled: no traceparent to send either)
            headers = dict(request.headers)
            _inject(headers, span)
            request = UpstreamRequest(request.method, request.url, request.body, headers,
                                      request.connect_timeout_s)
        try:
            response = await self.inner.send(request)
        except BaseException as exc:  # the span records the error and ends
            span.record_exception(exc)
            span.set_status(StatusCode.ERROR, type(exc).__name__)
            span.end()
            raise
        if recording:
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 400:
                span.set_status(StatusCode.ERROR)
        return _TracedResponse(response, span, observation)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _inject(headers: dict[str, str], span: Span) -> None:
    """What PROPAGATOR.inject(headers, set_span_in_context(span)) writes, without the detour
    through a context (W3C trace context: traceparent, and tracestate when there is one)."""
    context = span.get_span_context()
    headers["traceparent"] = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    if context.trace_state:
        headers["tracestate"] = context.trace_state.to_header()


class _TracedResponse(UpstreamResponse):
    def __init__(self, inner: UpstreamResponse, span: Span | None,
                 observation: RequestObservation) -> None:
        self._inner = inner
        self._span = span
        self._observation = observation
        self._ended = False
        self.status = inner.status
        self.headers = inner.headers

    async def read(self) -> bytes:
        return await self._inner.read()

    async def lines(self) -> AsyncIterator[bytes]:  # type: ignore[override]
        observation = self._observation
        async for line in self._inner.lines():
            if observation.first_upstream_line_at is None:
                observation.first_upstream_line_at = time.perf_counter()
                if self._span is not None:
                    self._span.add_event("first_line")
            yield line

    async def line_batches(self) -> AsyncIterator[list[bytes]]:  # type: ignore[override]
        observation = self._observation
        async for batch in self._inner.line_batches():
            if observation.first_upstream_line_at is None:
                observation.first_upstream_line_at = time.perf_counter()
                if self._span is not None:
                    self._span.add_event("first_line")
            yield batch

    def close(self) -> None:
        self._inner.close()
        if not self._ended:
            self._ended = True
            if self._span is not None:
                self._span.end()
