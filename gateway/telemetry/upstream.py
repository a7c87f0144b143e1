"""TracingTransport: wraps the gateway's Transport so each upstream call of a traced request gets
a CLIENT span (send -> close, so a stream's span lasts as long as the stream) and carries the
W3C `traceparent` of that span, which the replica continues. It also notes when the first body
line arrived (time to first token, for streams), through `lines` or `line_batches`, whichever the
backend reads; both forward to the wrapped response unchanged. Calls made outside a request
(health checks, the dashboard's own fetches) pass straight through.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from urllib.parse import urlsplit

from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.telemetry.attributes import AIGW_REPLICA
from gateway.telemetry.observation import RequestObservation, current_observation
from gateway.transport import Transport, UpstreamRequest, UpstreamResponse

PROPAGATOR: TextMapPropagator = TraceContextTextMapPropagator()


class TracingTransport(Transport):
    def __init__(self, inner: Transport, tracer: Tracer) -> None:
        self.inner = inner
        self._tracer = tracer

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        observation = current_observation()
        if observation is None:
            return await self.inner.send(request)
        parts = urlsplit(request.url)
        span = self._tracer.start_span(
            f"upstream {request.method} {parts.path}", kind=SpanKind.CLIENT,
            attributes={"http.request.method": request.method, "url.full": request.url,
                        "server.address": parts.hostname or "", "server.port": parts.port or 0,
                        AIGW_REPLICA: parts.netloc})
        headers = dict(request.headers)
        PROPAGATOR.inject(headers, context=set_span_in_context(span))
        try:
            response = await self.inner.send(replace(request, headers=headers))
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(StatusCode.ERROR, type(exc).__name__)
            span.end()
            raise
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 400:
            span.set_status(StatusCode.ERROR)
        return _TracedResponse(response, span, observation)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _TracedResponse(UpstreamResponse):
    def __init__(self, inner: UpstreamResponse, span: Span, observation: RequestObservation) -> None:
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
                self._span.add_event("first_line")
            yield line

    async def line_batches(self) -> AsyncIterator[list[bytes]]:  # type: ignore[override]
        observation = self._observation
        async for batch in self._inner.line_batches():
            if observation.first_upstream_line_at is None:
                observation.first_upstream_line_at = time.perf_counter()
                self._span.add_event("first_line")
            yield batch

    def close(self) -> None:
        self._inner.close()
        if not self._ended:
            self._ended = True
            self._span.end()
