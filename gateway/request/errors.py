"""Errors the gateway answers with, each carrying its HTTP status and a stable code.

    GatewayError(status, code, message)
     ├── BadRequest              400  malformed JSON, wrong types, missing fields
     ├── ModelNotFound           404  no model of that name is configured
     ├── PayloadTooLarge         413  body over settings.max_body_bytes
     ├── NoHealthyEndpoint       503  every endpoint of the model is unhealthy or ejected
     └── UpstreamError                the backend failed; `retryable` only before the first token
          ├── UpstreamUnavailable 502  connect refused/reset, 5xx, malformed upstream answer
          ├── UpstreamTimeout     504  no first token / no next chunk within the timeout
          ├── UpstreamThrottled   429  the upstream throttled us (retried on another endpoint;
          │                            the last one's Retry-After / x-ratelimit-* headers go to
          │                            the client with the 429; not a breaker failure)
          │    └── UpstreamOverloaded 429  a replica refused to queue the request past its TTFT
          │                            target (code latency_target): one more replica tried,
          │                            then the client gets the 429 with its Retry-After
          └── UpstreamRejected    4xx  the upstream refused the request itself (not retried);
                                       its OpenAI error (status, type, code, param, message) is
                                       passed through unchanged

`auth.principal.AuthError` (401/403) and `gateway.metering.contract.RateLimited` (429) come from
their own seams; the pipeline maps all three families onto the dialect's error envelope.
"""

from __future__ import annotations


class GatewayError(Exception):
    """`param` names the offending request field, if any; `error_type` overrides the envelope's
    type (an upstream's own OpenAI `type`, passed through unchanged)."""

    status: int = 500
    code: str = "internal_error"
    param: str | None = None
    error_type: str | None = None

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 param: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        if param is not None:
            self.param = param
        if error_type is not None:
            self.error_type = error_type


class BadRequest(GatewayError):
    status = 400
    code = "invalid_request"


class ModelNotFound(GatewayError):
    status = 404
    code = "model_not_found"

    @classmethod
    def named(cls, model: str) -> ModelNotFound:
        """A client's unknown model, with where the names are (a user who guessed one)."""
        return cls(f"the model {model!r} does not exist (GET /v1/models lists the models of "
                   f"this gateway)")


class PayloadTooLarge(GatewayError):
    status = 413
    code = "payload_too_large"


class NoHealthyEndpoint(GatewayError):
    status = 503
    code = "no_healthy_endpoint"


class UpstreamError(GatewayError):
    """The backend failed. `retryable` is True when another endpoint may be tried."""

    status = 502
    code = "upstream_error"
    retryable = True
    endpoint_name: str | None = None  # set by dispatch: the endpoint that failed or refused
    model_name: str | None = None  # set by dispatch: that endpoint's model (a fallback's, maybe)


class UpstreamUnavailable(UpstreamError):
    status = 502
    code = "upstream_unavailable"


class UpstreamAnswerTooLarge(UpstreamUnavailable):
    """A non-streamed answer over `max_upstream_answer_bytes`: dropped unread. The upstream did
    the work (a retry would likely do it again), so no retry; the request is billed as
    admitted (gateway/request/pipeline.py)."""

    retryable = False


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class UpstreamThrottled(UpstreamError):
    """A 429 from the upstream: another endpoint may be tried; `headers` are the upstream's
    Retry-After and x-ratelimit-* headers, passed to the client when no attempt is left."""

    status = 429
    code = "rate_limit_exceeded"
    error_type = "rate_limit_error"

    def __init__(self, message: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.headers = headers


class UpstreamOverloaded(UpstreamThrottled):
    """A replica's admission control: its predicted queueing delay would break the request's
    TTFT target (`code: latency_target`, contracts: the replica answers before any byte of a
    stream). Dispatch tries one other endpoint at most (every endpoint of a model sees the
    same traffic: a second refusal says the fleet is full); `predicted_queue_ms` is the
    refusing replica's estimate, when it said."""

    code = "latency_target"

    def __init__(self, message: str, headers: dict[str, str],
                 predicted_queue_ms: int | None = None) -> None:
        super().__init__(message, headers)
        self.predicted_queue_ms = predicted_queue_ms


class UpstreamRejected(UpstreamError):
    """A 4xx from the upstream: the request itself is at fault, so no retry."""

    code = "upstream_rejected"
    retryable = False
