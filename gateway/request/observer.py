"""`RequestObserver`: what the request path tells telemetry, one explicit call per fact.

The telemetry middleware makes one observer per request (gateway/telemetry/observers.py:
`RequestMetrics`, and `RequestTracing` for a sampled request, which also fills its trace) and
hands it to the pipeline on the aiohttp request (`observer_of(request)`); the pipeline puts it on
the `CanonicalRequest` (`canonical.observer`), so every step that request passes through (routing,
fallbacks, guards' classifier calls, the backend's upstream call) reaches the same object:

    Pipeline.handle                                   the observer is told
      admit      authenticate                         on_authenticated(started_ns, principal, error)
                 meter.admit                          on_admitting(model, project), on_admitted()
      dispatch   router.choose (each decision)        on_routed(request, candidates, decision, ...)
                 a hop down a fallback chain          on_fallback(from, to, reason, error)
                 a replica's latency-target 429       on_refused(request, model, retried)
                 backend: the upstream HTTP call      on_upstream_call(upstream) ->
                                                      UpstreamCallObserver
                 the stream's first event             on_first_token()
                 a session's turn explained           on_cache_turn(turn)
      settle     the request's usage record           on_settled(record)
                 another record it caused (a guard)   on_usage(record)

Every method has a no-op default, so `NULL_OBSERVER` (requests built outside an HTTP request,
tests) costs one call per fact and nothing else. An observer never raises into the request path
and never changes what the pipeline does; it only records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

    from auth.principal import Principal
    from gateway.fleet.endpoints import Endpoint
    from gateway.metering.contract import UsageRecord
    from gateway.request.canonical import CanonicalRequest
    from gateway.request.errors import GatewayError
    from gateway.routing.base import Decision, Router
    from gateway.upstream.transport import UpstreamRequest

TRACE_ID_HEADER = "x-aigw-trace-id"  # a sampled request's trace id, on its answer
OBSERVER_KEY = "aigw_observer"  # request[OBSERVER_KEY]: the request's observer (the middleware's)


class UpstreamCallObserver:
    """One upstream call of an observed request, told by the backend that makes it:
    `on_answered` once the status line arrived, `on_failed` when sending or reading the body
    broke, `on_ended` when the call is over (the body read, released or aborted)."""

    __slots__ = ()

    def on_answered(self, status: int) -> None:
        """The upstream's status line arrived."""

    def on_failed(self, exc: BaseException) -> None:
        """The call broke (connect, send, or a body that broke off); `on_ended` still follows
        for a body that had started."""

    def on_ended(self) -> None:
        """The call is over; a second call is a no-op."""


class RequestObserver:
    """The contract (module docstring): each method states a fact, none returns a decision."""

    __slots__ = ()
    trace_id: str | None = None  # the request's trace id (32 hex digits) when it is traced

    def on_authenticated(self, started_ns: int, principal: Principal | None,
                         error_code: str | None) -> None:
        """Authentication ended (`time.time_ns()` of its start): with a principal, or with the
        AuthError's code."""

    def on_admitting(self, model: str, project: str) -> None:
        """The request reached the meter: its configured model and the caller's project (the
        labels a refusal there, a 429, is counted under)."""

    def on_admitted(self) -> None:
        """The meter admitted it: a settle (`on_settled`) will follow."""

    def on_routed(self, request: CanonicalRequest, candidates: Sequence[Endpoint],
                  decision: Decision, started_ns: int, router: Router) -> None:
        """`router` chose `decision.endpoint` among `candidates` (once per attempt; its
        `explain(request_id)` says why)."""

    def on_fallback(self, request: CanonicalRequest, from_model: str, to_model: str,
                    reason: str, error: GatewayError) -> None:
        """The request goes down its model's fallback chain, before its first token."""

    def on_refused(self, request: CanonicalRequest, model: str, retried: bool) -> None:
        """A replica of `model` refused the request for its latency target (429 latency_target,
        gateway/request/dispatch.py); `retried`: another endpoint is tried next."""

    def on_upstream_call(self, upstream: UpstreamRequest) -> UpstreamCallObserver | None:
        """The backend is about to send `upstream`; the observer may add trace-context headers
        to `upstream.headers` (its own dict). None: nothing more to tell of this call."""
        return None

    def on_first_token(self) -> None:
        """A stream's first event arrived from the upstream that will answer it."""

    def on_cache_turn(self, turn: Any) -> None:
        """The request was explained as its session's next turn
        (gateway/request/cache_explainer.py)."""

    def on_settled(self, record: UsageRecord) -> None:
        """The request's one usage record went to the meter (queued or written)."""

    def on_usage(self, record: UsageRecord) -> None:
        """A usage record settled on the request's behalf that is not its own (a guardrail's
        classifier call), or one of a request outside HTTP (a batch line)."""


NULL_OBSERVER = RequestObserver()


def observer_of(request: web.BaseRequest) -> RequestObserver:
    """The request's observer (set by the telemetry middleware), else `NULL_OBSERVER`."""
    try:
        observer: RequestObserver = request[OBSERVER_KEY]
    except KeyError:
        return NULL_OBSERVER
    return observer
