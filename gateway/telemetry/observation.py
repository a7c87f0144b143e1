"""The one piece of per-request telemetry state, shared by the middleware and the hooks.

The middleware creates a `RequestObservation` and makes it current (a contextvar, so tasks the
handler spawns, such as the shielded settle, see the same object); hooks fill it in.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass

from gateway.metering.contract import UsageRecord
from gateway.telemetry.request_trace import RequestTrace


@dataclass(slots=True)
class RequestObservation:
    started: float  # time.perf_counter() when the request came in
    trace: RequestTrace | None  # what the request's spans are built from; None: not traced/sampled
    record: UsageRecord | None = None  # set when the pipeline settles with the meter
    first_upstream_line_at: float | None = None  # perf_counter of the first upstream body line
    is_admitted: bool = False  # the meter admitted it, so a settle (and a record) will follow
    # The metric labels once the request reached admission (its model configured, its caller
    # known), so a refusal there (429) is counted under them although it leaves no record.
    model: str = ""
    project: str = ""
    on_settled: Callable[[], None] | None = None  # the middleware's finish, if it had to wait
    # Tracing on but this request not sampled: the `traceparent` (flags 00) its upstream calls
    # carry, so that a replica does not start a trace of its own for it.
    unsampled_traceparent: str | None = None
    unsampled_tracestate: str | None = None  # the caller's `tracestate`, passed on with it


_CURRENT: contextvars.ContextVar[RequestObservation | None] = contextvars.ContextVar(
    "aigw_request_observation", default=None)


# The contextvar's own methods, bound once: a hook reads the observation with one C call, no
# Python frame (these run several times on every request's path).
current_observation: Callable[[], RequestObservation | None] = _CURRENT.get
set_current: Callable[[RequestObservation | None], contextvars.Token[RequestObservation | None]] = _CURRENT.set
reset_current: Callable[[contextvars.Token[RequestObservation | None]], None] = _CURRENT.reset
