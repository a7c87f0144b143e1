"""The Backend interface: how the gateway talks to one kind of upstream.

Contract of `stream(request, endpoint)`:
  - yields `TextDelta`/`ToolCallDelta`* then exactly one `Finish` then exactly one `Usage`;
  - raises `UpstreamError` (gateway/request/errors.py) on any failure, before or after the first
    event, and never ends early without one (a truncated upstream stream is an error, not a finish);
  - closing the iterator (aclose, or cancelling the task awaiting it) aborts the upstream request
    and releases its connection;
  - it does not apply first-token/idle timeouts: the pipeline does, around each event.
`health` and `load` are called by the health checker, never on the request path.
`count_prompt_tokens` is CPU-bound (it may tokenize): callers run it off the event loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from gateway.fleet.endpoints import Endpoint, EndpointLoad
from gateway.request.canonical import CanonicalEvent, CanonicalRequest, estimate_prompt_tokens
from gateway.settings import GatewaySettings
from gateway.upstream.transport import Transport


class Backend(ABC):
    name: str = "base"

    def __init__(self, transport: Transport, settings: GatewaySettings) -> None:
        self.transport = transport
        self.settings = settings

    @abstractmethod
    def stream(self, request: CanonicalRequest,
               endpoint: Endpoint) -> AsyncIterator[CanonicalEvent]:
        """Run the request on `endpoint` (see the module contract)."""

    async def abort(self, request_id: str, endpoint: Endpoint) -> None:  # noqa: B027
        """Ask the upstream to stop `request_id` beyond closing its stream (optional)."""

    @abstractmethod
    async def health(self, endpoint: Endpoint) -> bool:
        """True if the endpoint can take requests now. Must not raise."""

    async def load(self, endpoint: Endpoint) -> EndpointLoad | None:
        """What the endpoint reports about its load, or None if it reports nothing. Must not
        raise."""
        return None

    async def context_length(self, endpoint: Endpoint) -> int | None:
        """The model's context length as the endpoint reports it. Must not raise."""
        return None

    def count_prompt_tokens(self, request: CanonicalRequest, endpoint: Endpoint) -> int:
        """The prompt tokens `request` would cost on `endpoint` (Anthropic's count_tokens); by
        default the documented estimate (~4 characters a token plus framing per message)."""
        return estimate_prompt_tokens(request)
