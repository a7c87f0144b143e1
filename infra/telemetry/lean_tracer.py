"""A lean OpenTelemetry tracer: the API's Tracer/Span, at a fraction of the SDK's cost per span.

    provider = LeanTracerProvider(resource, sample_ratio=1.0, processors=[SpanBuffer(), ...])
    tracer = provider.get_tracer("aigw.replica")       # an opentelemetry.trace.Tracer

The replica's tracer (engine/server/tracing.py). The gateway's request path goes one step further
and makes no span objects at all: it notes raw facts in a `RequestTrace` and builds spans when
they are read (gateway/telemetry/request_trace.py); it shares `new_span_context` (ids, flags and
sampling) with this tracer. Why not the SDK's own `TracerProvider`: for a request's 4 spans and
about 25 attributes it cost ~200 us of CPU on this VM, most of it in work a caller that sets its
own attributes does not need: validating and copying every attribute value (`BoundedAttributes`),
a lock per attribute write and per end, a fresh `ReadableSpan` copy per end, tracer metrics.
Here a span is one object that *is* its own `ReadableSpan` (the SDK's read side, so `SpanBuffer`
and the SDK's `BatchSpanProcessor` + OTLP exporter take it as is): attributes are a plain dict,
`end()` hands the span itself to each processor's `on_end`.

Semantics kept from the SDK set-up this replaces: W3C trace context (random 128-bit trace ids,
64-bit span ids, the sampled and random-trace-id flags), parent-based sampling over a trace-id
ratio (`TraceIdRatioBased`'s exact rule), spans continue the current context's span or the one in
`context`, `start_time`/`end(end_time)` in ns, status and events (`record_exception`), writes
after `end()` ignored. Not kept: attribute validation (callers set str/bool/int/float or lists
of them; None values are dropped) and span limits (`SpanBuffer` bounds spans per trace).
Spans are not thread-safe: each is written by the task that started it (the event loop).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    DEFAULT_TRACE_STATE,
    INVALID_SPAN,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from infra.telemetry.attributes import exception_attributes

_UNSET = Status(StatusCode.UNSET)
_SAMPLED_RANDOM = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED_RANDOM = TraceFlags(TraceFlags.RANDOM_TRACE_ID)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_RANDOM = TraceFlags.RANDOM_TRACE_ID
_TRACE_ID_LOW_64 = (1 << 64) - 1
_tuple_new = tuple.__new__
_getrandbits = random.getrandbits
_time_ns = time.time_ns


def _current_span_getter() -> Any:
    """`trace.get_current_span()` as two C calls where the API's runtime context is its default
    contextvars one (else the API's own function)."""
    from opentelemetry.context import _RUNTIME_CONTEXT
    from opentelemetry.trace.propagation import _SPAN_KEY

    var = getattr(_RUNTIME_CONTEXT, "_current_context", None)
    if var is None:
        return trace_api.get_current_span

    def current_span() -> trace_api.Span:
        return var.get().get(_SPAN_KEY) or INVALID_SPAN

    return current_span


_current_span = _current_span_getter()


def new_span_id() -> int:
    """A random non-zero 64-bit span id (W3C trace context)."""
    return _getrandbits(64) or 1


def new_trace_id() -> int:
    """A random non-zero 128-bit trace id (W3C trace context)."""
    return _getrandbits(128) or 1


def new_span_context(parent: SpanContext | None, bound: int) -> SpanContext:
    """A new span's context: a child of `parent` (same trace, its sampled decision), or the root of
    a new trace sampled when the trace id's low 64 bits are under `bound` (TraceIdRatioBased's rule;
    `LeanTracerProvider.bound`)."""
    span_id = new_span_id()
    # SpanContext is a tuple: (trace_id, span_id, is_remote, flags, trace_state, is_valid)
    if parent is not None:
        trace_id = parent[0]
        sampled = bool(parent[3] & TraceFlags.SAMPLED)
        flags = (_SAMPLED if sampled else _NOT_SAMPLED) if not parent[3] & _RANDOM \
            else (_SAMPLED_RANDOM if sampled else _NOT_SAMPLED_RANDOM)
        trace_state = parent[4]
    else:
        trace_id = new_trace_id()
        sampled = trace_id & _TRACE_ID_LOW_64 < bound
        flags = _SAMPLED_RANDOM if sampled else _NOT_SAMPLED_RANDOM
        trace_state = DEFAULT_TRACE_STATE
    # what SpanContext(trace_id, span_id, False, flags, trace_state) builds, without its
    # validation: both ids are in range and non-zero by construction
    return _tuple_new(SpanContext, (trace_id, span_id, False, flags, trace_state, True))


class LeanSpan(trace_api.Span, ReadableSpan):
    """A recording span; `ReadableSpan`'s properties read the fields set here (fields that
    rarely change start as class attributes, so a span is built with few writes)."""

    _end_time: int | None = None
    _status = _UNSET
    _events: tuple[Event, ...] | list[Event] = ()
    _links: tuple[trace_api.Link, ...] = ()
    _instrumentation_info = None

    def __init__(self, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
                 attributes: dict[str, Any], start_time: int, tracer: LeanTracer) -> None:
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._attributes = attributes
        self._start_time = start_time
        self._tracer = tracer

    @property
    def resource(self) -> Resource:
        return self._tracer.resource

    @property
    def instrumentation_scope(self) -> InstrumentationScope:
        return self._tracer.scope

    def get_span_context(self) -> SpanContext:
        return self._context  # type: ignore[return-value]  # set in __init__, never None

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end_time is None and value is not None:
            self._attributes[key] = value  # type: ignore[index]  # a dict, made in __init__

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self._end_time is None:
            self._attributes.update(attributes)  # type: ignore[union-attr]  # a dict, as above

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None,
                  timestamp: int | None = None) -> None:
        if self._end_time is None:
            event = Event(name, attributes or {}, timestamp or _time_ns())
            if isinstance(self._events, list):
                self._events.append(event)
            else:
                self._events = [event]

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self._end_time is None:
            self._links += (trace_api.Link(context, attributes),)

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        """The SDK's rule: OK is final, UNSET never overwrites."""
        if self._end_time is not None or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self._status = status

    def record_exception(self, exception: BaseException,
                         attributes: Mapping[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        values = exception_attributes(exception, escaped)
        if attributes:
            values.update(attributes)
        self.add_event("exception", values, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = end_time if end_time is not None else _time_ns()
        for processor in self._tracer.processors:
            processor.on_end(self)

    def __exit__(self, exc_type: Any, exc_val: BaseException | None, exc_tb: Any) -> None:
        if exc_val is not None and self._end_time is None:
            self.record_exception(exc_val, escaped=True)
            self.set_status(Status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}"))
        self.end()


class LeanTracer(trace_api.Tracer):
    def __init__(self, provider: LeanTracerProvider, scope: InstrumentationScope) -> None:
        self.resource = provider.resource
        self.processors = provider.processors  # shared list: processors added later apply too
        self.scope = scope
        self._is_enabled = provider.is_enabled
        self._bound = provider.bound

    def start_span(self, name: str, context: Context | None = None,
                   kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None,
                   links: Sequence[trace_api.Link] | None = None, start_time: int | None = None,
                   record_exception: bool = True, set_status_on_exception: bool = True
                   ) -> trace_api.Span:
        parent = (_current_span() if context is None else trace_api.get_current_span(context)
                  ).get_span_context()
        if not self._is_enabled:
            return INVALID_SPAN if not parent.is_valid else NonRecordingSpan(parent)
        parent = parent if parent[5] else None
        span_context = new_span_context(parent, self._bound)
        if not span_context[3] & TraceFlags.SAMPLED:
            return NonRecordingSpan(span_context)
        values = dict(attributes) if attributes else {}
        if None in values.values():
            values = {k: v for k, v in values.items() if v is not None}
        span = LeanSpan(name, span_context, parent, kind, values,
                        start_time if start_time is not None else _time_ns(), self)
        if links:
            span._links = tuple(links)
        return span

    @contextmanager
    def start_as_current_span(  # type: ignore[override]  # a generator context manager
            self, name: str, context: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
            attributes: Mapping[str, Any] | None = None,
            links: Sequence[trace_api.Link] | None = None, start_time: int | None = None,
            record_exception: bool = True, set_status_on_exception: bool = True,
            end_on_exit: bool = True) -> Iterator[trace_api.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace_api.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                                set_status_on_exception=set_status_on_exception) as current:
            yield current


class LeanTracerProvider(trace_api.TracerProvider):
    """`is_enabled` False: every span is non-recording (and never reaches a processor)."""

    def __init__(self, resource: Resource, sample_ratio: float = 1.0, is_enabled: bool = True,
                 processors: Sequence[SpanProcessor] = ()) -> None:
        self.resource = resource
        self.is_enabled = is_enabled
        self.bound = TraceIdRatioBased.get_bound_for_rate(sample_ratio)
        self.processors: list[SpanProcessor] = list(processors)

    def add_span_processor(self, processor: SpanProcessor) -> None:
        self.processors.append(processor)

    def get_tracer(self, instrumenting_module_name: str,
                   instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: Any = None) -> LeanTracer:
        return LeanTracer(self, InstrumentationScope(instrumenting_module_name,
                                                     instrumenting_library_version, schema_url))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(p.force_flush(timeout_millis) for p in self.processors)

    def shutdown(self) -> None:
        for processor in self.processors:
            processor.shutdown()
