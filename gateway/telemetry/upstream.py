"""TracingTransport: wraps the gateway's Transport so each upstream call of a traced request is
noted in the request's trace (an `UpstreamCall`: send -> close, so a stream's call lasts as long as
the stream) and carries the W3C `traceparent` of that call's CLIENT span, which the replica
continues. It also notes when the first body line arrived (time to first token, for streams),
through `lines` or `line_batches`, whichever the backend reads; both forward to the wrapped
response unchanged. Calls made outside a request (health checks, the dashboard's own fetches)
pass straight through; a request that is not traced (tracing off, or not sampled) only gets its
first line's time noted, and, when not sampled, a `traceparent` with flags 00 (the replica's
parent-based sampler then records nothing, instead of starting a trace of its own).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Any, TypeVar
from urllib.parse import urlsplit

from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.telemetry.observation import RequestObservation, current_observation
from gateway.telemetry.request_trace import UpstreamCall
from gateway.upstream.transport import Transport, UpstreamRequest, UpstreamResponse
from infra.telemetry.attributes import AIGW_REPLICA, exception_attributes

PROPAGATOR: TextMapPropagator = TraceContextTextMapPropagator()
TRACE_FLAGS_HEX = tuple(f"{value:02x}" for value in range(256))  # trace flags -> their two hex digits
_time_ns = time.time_ns
T = TypeVar("T")


@lru_cache(maxsize=1024)
def _span_shape(method: str, url: str) -> tuple[str, dict[str, Any]]:
    """(span name, attributes) of a call; a gateway calls few distinct URLs, so each is parsed once
    (the dict is shared by every call to that URL: read, never written)."""
    parts = urlsplit(url)
    return (f"upstream {method} {parts.path}",
            {"http.request.method": method, "url.full": url, "server.address": parts.hostname or "",
             "server.port": parts.port or 0, AIGW_REPLICA: parts.netloc})


class TracingTransport(Transport):
    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        observation = current_observation()
        if observation is None:
            return await self.inner.send(request)
        trace = observation.trace
        if trace is None:
            if observation.unsampled_traceparent is not None:  # not sampled: nor upstream
                request.headers["traceparent"] = observation.unsampled_traceparent
                if observation.unsampled_tracestate is not None:
                    request.headers["tracestate"] = observation.unsampled_tracestate
            return _TracedResponse(await self.inner.send(request), None, observation)
        name, attributes = _span_shape(request.method, request.url)
        call = trace.new_call(name, attributes, _time_ns())
        # SpanContext is a tuple: (trace_id, span_id, is_remote, trace_flags, trace_state, is_valid)
        context = trace.context
        headers = request.headers  # the request's own (UpstreamRequest: wrappers may add to it)
        # W3C trace context: what PROPAGATOR.inject writes for the call's CLIENT span
        headers["traceparent"] = ("00-" + trace.trace_id_hex + "-" + call.span_id.to_bytes(8, "big").hex()
                                  + "-" + TRACE_FLAGS_HEX[context[3]])
        if trace.parent is not None and context[4]:  # (a new trace's state is the empty default)
            headers["tracestate"] = context[4].to_header()
        try:
            response = await self.inner.send(request)
        except BaseException as exc:  # the call records the error and ends
            call.end_ns = _time_ns()
            call.exception = exception_attributes(exc)
            raise
        call.status_code = response.status
        return _TracedResponse(response, call, observation)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _TracedResponse(UpstreamResponse):
    def __init__(self, inner: UpstreamResponse, call: UpstreamCall | None,
                 observation: RequestObservation) -> None:
        self._inner = inner
        self._call = call
        self._observation = observation
        self.status = inner.status
        self.headers = inner.headers

    async def read(self) -> bytes:
        return await self._inner.read()

    def lines(self) -> AsyncIterator[bytes]:
        return self._watched(self._inner.lines())

    def line_batches(self) -> AsyncIterator[list[bytes]]:
        return self._watched(self._inner.line_batches())

    async def _watched(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """`items` as they come (one generator layer, as before), noting the first one's time and
        a body that breaks off."""
        observation = self._observation
        try:
            async for item in items:
                if observation.first_upstream_line_at is None:
                    self._note_first_line()
                yield item
        except Exception as exc:
            self._failed(exc)
            raise

    def _note_first_line(self) -> None:
        self._observation.first_upstream_line_at = time.perf_counter()
        if self._call is not None:
            self._call.first_line_ns = _time_ns()

    def _failed(self, exc: Exception) -> None:
        """The body broke off after the status line (a replica that died mid-stream): the call
        records the error, as one that failed to send does."""
        call = self._call
        if call is not None and call.exception is None:
            call.end_ns = _time_ns()
            call.exception = exception_attributes(exc)

    def close(self) -> None:
        self._inner.close()
        self._end_call()

    def release(self) -> None:
        self._inner.release()
        self._end_call()

    def _end_call(self) -> None:
        if self._call is not None and self._call.end_ns is None:
            self._call.end_ns = _time_ns()
