"""SpanBuffer: an OpenTelemetry SpanProcessor that keeps the most recent traces in memory.

It takes finished spans (`on_end`, the SpanProcessor side: the replica's tracer) and finished
whole-request traces (`add`: any `TraceRecord`, such as the gateway's `RequestTrace`: raw records
whose spans are built only when read). Either only
appends to a queue: no lock, no serialization on the request path. Spans are folded into
per-trace lists when read (or once `num_traces * 4` are queued); a `TraceRecord` is a whole
trace, so its queue simply keeps the last `num_traces` (older ones drop out as new ones come:
nothing is kept longer than the dashboard can show, which also keeps the collector's work per
request flat) and is folded only when read. Readers turn spans into plain JSON dicts
(`span_json`). Bounded: at most `num_traces` traces (the least recently touched
is dropped) and `num_spans_per_trace` spans each. Thread-safe (the replica's engine side and the
event loop may both end spans).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Any, Protocol

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import SpanContext, format_span_id, format_trace_id


class TraceRecord(Protocol):
    """A whole trace kept raw until read (the gateway's `RequestTrace`)."""

    context: SpanContext  # its root span's; `context.trace_id` files it

    def spans(self) -> list[ReadableSpan]:
        """Its spans, root first (built on the first call)."""
        ...


Entry = ReadableSpan | TraceRecord  # a finished span, or a whole request's trace (>= 1 span)


class SpanBuffer(SpanProcessor):
    def __init__(self, num_traces: int = 200, num_spans_per_trace: int = 64) -> None:
        self._num_traces = num_traces
        self._num_spans_per_trace = num_spans_per_trace
        self._ended: deque[Entry] = deque()  # appends and pops are atomic
        self._requests: deque[TraceRecord] = deque(maxlen=num_traces)  # the newest, unfolded
        self._num_ended_max = num_traces * 4
        self._traces: OrderedDict[int, list[Entry]] = OrderedDict()
        self._lock = threading.Lock()  # guards _traces (and folding)

    def on_end(self, span: ReadableSpan) -> None:
        self._ended.append(span)
        if len(self._ended) >= self._num_ended_max:
            self._fold()

    def add(self, trace: TraceRecord) -> None:
        self._requests.append(trace)

    def _fold(self) -> None:
        """Move the queued requests and ended spans into their traces, oldest first (a run of
        spans of one trace, the usual case, costs one lookup)."""
        with self._lock:
            requests, traces = self._requests, self._traces
            num_traces, cap = self._num_traces, self._num_spans_per_trace
            while requests:
                request = requests.popleft()
                # (requests continuing one caller's trace share it)
                trace_id = request.context.trace_id
                found = traces.get(trace_id)
                if found is None:
                    traces[trace_id] = [request]
                    if len(traces) > num_traces:
                        traces.popitem(last=False)
                else:
                    if len(found) < cap:
                        found.append(request)
                    traces.move_to_end(trace_id)
            ended = self._ended
            last_trace_id: int | None = None
            spans: list[Entry] = []
            while ended:
                span = ended.popleft()
                trace_id = span.context[0]  # (SpanContext is a tuple: trace id first)
                if trace_id != last_trace_id:
                    last_trace_id = trace_id
                    found = traces.get(trace_id)
                    if found is None:
                        spans = traces[trace_id] = []
                        if len(traces) > num_traces:
                            traces.popitem(last=False)
                    else:
                        spans = found
                        traces.move_to_end(trace_id)
                if len(spans) < cap:
                    spans.append(span)

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        """The buffered spans of one trace (32 hex digits), oldest start first; [] if unknown."""
        try:
            key = int(trace_id, 16)
        except ValueError:
            return []
        self._fold()
        with self._lock:
            entries = list(self._traces.get(key, ()))
        return self._json(entries)

    def recent(self, num_traces: int = 50) -> list[list[dict[str, Any]]]:
        """The most recently touched traces, newest first, each as `trace()` returns it."""
        self._fold()
        with self._lock:
            picked = list(self._traces.values())[-num_traces:][::-1]
            picked = [list(entries) for entries in picked]
        return [self._json(entries) for entries in picked]

    def _json(self, entries: list[Entry]) -> list[dict[str, Any]]:
        """One trace's spans as JSON, oldest start first, at most `num_spans_per_trace`."""
        spans: list[ReadableSpan] = []
        for entry in entries:
            if isinstance(entry, ReadableSpan):
                spans.append(entry)
            else:
                spans.extend(entry.spans())
        return sorted((span_json(s) for s in spans[:self._num_spans_per_trace]),
                      key=lambda s: s["start_ns"])

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_json(span: ReadableSpan) -> dict[str, Any]:
    parent = span.parent
    resource = span.resource.attributes if span.resource is not None else {}
    return {
        "trace_id": format_trace_id(span.context.trace_id),
        "span_id": format_span_id(span.context.span_id),
        "parent_span_id": format_span_id(parent.span_id) if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "service": str(resource.get("service.name", "")),
        "start_ns": span.start_time or 0,
        "end_ns": span.end_time or span.start_time or 0,
        "status": span.status.status_code.name,
        "attributes": {k: _plain(v) for k, v in (span.attributes or {}).items()},
    }


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
