"""Every failure the replica answers, in OpenAI's envelope:

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Exception tree (raise these in handlers; the error middleware renders them):

    APIError                          500 server_error (base; never shows a traceback)
     ├── InvalidRequestError          400 invalid_request_error  (bad JSON, types, ranges, missing)
     │    └── ContextLengthExceeded   400 invalid_request_error, code context_length_exceeded
     ├── AuthenticationError          401 authentication_error
     ├── PermissionDeniedError        403 permission_error
     ├── NotFoundError                404 invalid_request_error  (model_not_found, unknown route)
     ├── LatencyTargetError           429 server_overloaded, code latency_target (admission control:
     │                                    Retry-After and x-aigw-predicted-queue-ms headers)
     └── ServiceUnavailableError      503 server_error           (engine loop not alive)

aiohttp's own HTTP errors (404/405 routes, 413 body over `client_max_size`) are rendered in the
same envelope by the middleware; anything else becomes a logged 500.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web


class APIError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_response(self) -> web.Response:
        return json_error(self.status, self.message, self.type, param=self.param, code=self.code)


class InvalidRequestError(APIError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequestError):
    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class AuthenticationError(APIError):
    status = 401
    type = "authentication_error"


class PermissionDeniedError(APIError):
    status = 403
    type = "permission_error"


class NotFoundError(APIError):
    status = 404
    type = "invalid_request_error"


PREDICTED_QUEUE_HEADER = "x-aigw-predicted-queue-ms"


class LatencyTargetError(APIError):
    """The replica refuses a request at once, before any byte of an answer, because its predicted
    queueing delay would break its class's TTFT target (engine/admission.py). `Retry-After` is the
    estimate in whole seconds (rounded up, at least 1); PREDICTED_QUEUE_HEADER the estimate in
    ms."""

    status = 429
    type = "server_overloaded"

    def __init__(self, message: str, *, retry_after_s: int, predicted_queue_ms: int) -> None:
        super().__init__(message, code="latency_target")
        self.retry_after_s = retry_after_s
        self.predicted_queue_ms = predicted_queue_ms

    def to_response(self) -> web.Response:
        response = super().to_response()
        response.headers["Retry-After"] = str(self.retry_after_s)
        response.headers[PREDICTED_QUEUE_HEADER] = str(self.predicted_queue_ms)
        return response


class ServiceUnavailableError(APIError):
    status = 503
    type = "server_error"


def error_body(message: str, type_: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def json_error(status: int, message: str, type_: str, *, param: str | None = None,
               code: str | None = None) -> web.Response:
    return json_response(error_body(message, type_, param=param, code=code), status=status)
