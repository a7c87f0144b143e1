"""What the pipeline calls to log a sampled request: `capture(...)` builds the cheap `Capture`
(references, no copies; the writer renders and redacts it later, off the request path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.dialects.base import Dialect
from gateway.metering.contract import UsageRecord
from gateway.request.canonical import Accumulator, CanonicalRequest
from gateway.request_logs.entry import Capture

REQUEST_BODY = "aigw_request_body"  # request[REQUEST_BODY]: the parsed JSON, kept when logging
_FIXED_WEIGHT_BYTES = 1024  # headers, metadata


def keep_body(request: web.Request, body: Any) -> None:
    request[REQUEST_BODY] = body


def capture(request: web.Request, dialect: Dialect, canonical: CanonicalRequest,
            accumulator: Accumulator, error: tuple[str, str] | None, record: UsageRecord,
            mask: Callable[[str], str] | None = None) -> Capture:
    """`mask`: the request guards' masking (RequestGuards.body_masker), for the logged body; the
    trace id is the request's observer's (gateway/request/observer.py), when it is traced."""
    body_bytes = max(request.content_length or 0, canonical.text_length())
    return Capture(
        body=request.get(REQUEST_BODY), headers=list(request.headers.items()), path=request.path,
        dialect=dialect, request=canonical,
        response=accumulator.response() if accumulator.num_events else None, error=error,
        record=record, trace_id=canonical.observer.trace_id,
        weight_bytes=_FIXED_WEIGHT_BYTES + body_bytes + accumulator.num_generated_chars, mask=mask)
