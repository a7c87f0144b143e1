"""A dialect: one public API shape, translated to and from the canonical form.

Contract: `parse` validates completely and raises `BadRequest` (never KeyError/TypeError);
`render` and the `StreamEncoder` only read the canonical response. A dialect holds no I/O:
streaming, retries and metering live once, in gateway/request/pipeline.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from gateway.request.canonical import (
    CanonicalEvent,
    CanonicalRequest,
    CanonicalResponse,
    PromptUsage,
)


class StreamEncoder(ABC):
    """Turns one request's events into SSE bytes; called in order start, event*, finish|error."""

    @abstractmethod
    def start(self, prompt: PromptUsage | None = None) -> bytes:
        """The stream's opening bytes; `prompt`: the prompt's count, when the upstream announced
        it as it started answering (the Anthropic dialect reports it in `message_start`)."""

    @abstractmethod
    def event(self, event: CanonicalEvent) -> bytes:
        """A TextDelta or ToolCallDelta (Finish and Usage come folded into `finish`)."""

    @abstractmethod
    def finish(self, response: CanonicalResponse) -> bytes: ...

    @abstractmethod
    def error(self, status: int, code: str, message: str) -> bytes:
        """The stream's last bytes when it fails after it started."""

    def answer(self) -> dict[str, Any] | None:
        """After `finish` or `error`: the object the stream's end stands for (the Responses
        API's final response object, which a stored response keeps), or None (most dialects)."""
        return None


class Dialect(ABC):
    name: str

    @abstractmethod
    def parse(self, body: Any, request_id: str) -> CanonicalRequest: ...

    @abstractmethod
    def render(self, request: CanonicalRequest, response: CanonicalResponse) -> dict[str, Any]: ...

    @abstractmethod
    def encoder(self, request: CanonicalRequest) -> StreamEncoder: ...

    @abstractmethod
    def error_body(self, status: int, code: str, message: str, param: str | None = None,
                   error_type: str | None = None) -> dict[str, Any]:
        """The error envelope; `param` and `error_type` are used where the dialect has them."""
