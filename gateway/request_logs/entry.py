"""One request log entry: what the pipeline hands over (`Capture`, cheap, on the request path) and
the stored JSON built from it off the request path (`build_entry`).

    {"id", "request_id", "project", "key_id", "model", "endpoint", "trace_id", "created_at",
     "path", "stream", "status", "latency_ms", "finish_reason", "cost_usd",
     "usage": {"prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens"},
     "headers": {...}, "request": {...}, "response": {...} | null,
     "error": {"code", "message"} | null, "truncated": false}

`response` is the answer in the dialect's non-streamed form (a stream's too, as its events add
up). An entry over `max_entry_bytes` keeps its metadata; the bodies are then replaced by their
JSON text cut to fit (`"truncated": true`, each as `{"text": "..."}`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.dialects.base import Dialect
from gateway.metering.contract import UsageRecord
from gateway.request.canonical import CanonicalRequest, CanonicalResponse
from gateway.request_logs.redact import redact_headers, redact_paths, redact_value

_HEADER_LIMIT = 64  # headers kept per entry


@dataclass(slots=True)
class Capture:
    """A sampled request as the pipeline saw it, kept by reference until the writer builds it."""

    body: Any  # the request's JSON, as parsed
    headers: list[tuple[str, str]]
    path: str
    dialect: Dialect
    request: CanonicalRequest
    response: CanonicalResponse | None  # None when no answer was built (an error before it)
    error: tuple[str, str] | None  # (code, message) of the error answered, if any
    record: UsageRecord
    trace_id: str | None
    weight_bytes: int  # what it holds, roughly (the queue's bound counts this)
    mask: Callable[[str], str] | None = None  # the request guards' masking, for the body's strings


@dataclass(frozen=True, slots=True)
class LogEntry:
    """A built entry: the columns a store filters on, and the entry's JSON."""

    id: str
    project: str
    model: str
    trace_id: str | None
    created_at: float
    data: bytes  # the entry's JSON (UTF-8)

    @property
    def num_bytes(self) -> int:
        return len(self.data)


def build_entry(capture: Capture, max_entry_bytes: int, redact_fields: tuple[str, ...]) -> LogEntry:
    record = capture.record
    response: Any = None
    if capture.response is not None:
        response = capture.dialect.render(capture.request, capture.response)
    entry: dict[str, Any] = {
        "id": record.request_id, "request_id": capture.request.request_id,
        "project": record.project, "key_id": record.key_id, "model": record.model,
        "endpoint": record.endpoint, "trace_id": capture.trace_id, "created_at": record.created_at,
        "path": capture.path, "stream": record.stream, "status": record.status,
        "latency_ms": round(record.latency_ms, 3), "finish_reason": record.finish_reason,
        "cost_usd": record.cost_usd,
        "usage": {"prompt_tokens": record.prompt_tokens, "cached_tokens": record.cached_tokens,
                  "completion_tokens": record.completion_tokens,
                  "reasoning_tokens": record.reasoning_tokens},
        "headers": redact_headers(capture.headers[:_HEADER_LIMIT]),
        "request": redact_value(capture.body, capture.mask),
        "response": redact_value(response),
        "error": ({"code": capture.error[0], "message": capture.error[1]}
                  if capture.error is not None else None),
        "truncated": False,
    }
    if redact_fields:
        redact_paths(entry, redact_fields)
    data = orjson.dumps(entry)
    if len(data) > max_entry_bytes:
        data = _truncated(entry, max_entry_bytes)
    return LogEntry(record.request_id, record.project, record.model, capture.trace_id,
                    record.created_at, data)


def _truncated(entry: dict[str, Any], max_entry_bytes: int) -> bytes:
    """The entry with its bodies (and headers) as cut JSON text, within `max_entry_bytes`."""
    bodies = {name: orjson.dumps(entry[name]).decode() for name in ("request", "response")}
    entry = {**entry, "request": None, "response": None, "headers": {}, "truncated": True}
    if entry["error"] is not None:
        entry["error"] = {**entry["error"], "message": entry["error"]["message"][:1024]}
    room = max(0, max_entry_bytes - len(orjson.dumps(entry)) - 64)
    # the smaller body whole if it fits in half, the other gets the rest
    small, large = sorted(bodies, key=lambda name: len(bodies[name]))
    share = {small: min(len(bodies[small]), room // 2)}
    share[large] = room - share[small]
    for name, text in bodies.items():
        entry[name] = {"text": _cut(text, max(0, share[name]))}
    out = orjson.dumps(entry)
    while len(out) > max_entry_bytes and any(entry[name]["text"] for name in bodies):
        for name in bodies:  # (escapes or non-ASCII grew it: cut some more)
            entry[name] = {"text": entry[name]["text"][: len(entry[name]["text"]) * 3 // 4]}
        out = orjson.dumps(entry)
    return out


def _cut(text: str, num_chars: int) -> str:
    return text if len(text) <= num_chars else text[:num_chars]
