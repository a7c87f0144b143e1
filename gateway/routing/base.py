"""The Router interface: given a request and the endpoints that may serve it, pick one.

Contract: `pick` is called on the event loop and must not block or await; `choose` is its
awaitable form (one network round trip allowed, e.g. a Redis index lookup), by default `pick`;
the gateway's dispatch awaits `choose`. `start(fleet)` / `close()` bracket the router's life
(background tasks such as KV event consumers); `explain(request_id)` returns a one-line account
of a recent decision for debug headers, or None. `endpoints` is non-empty
and holds only endpoints that can serve right now (healthy, breaker not open, not already tried
for this request). A router keeps its own state (e.g. a prefix index) and may read, never write,
`Endpoint` fields.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.fleet.endpoints import Endpoint, Fleet
from gateway.request.canonical import CanonicalRequest


@dataclass(frozen=True, slots=True)
class Decision:
    endpoint: Endpoint
    reason: str = ""  # for logs and the bench: "least_outstanding", "prefix_hit", ...


class Router(ABC):
    @abstractmethod
    def pick(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision: ...

    async def choose(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        return self.pick(request, endpoints)

    async def start(self, fleet: Fleet) -> None:
        return None

    async def close(self) -> None:
        return None

    async def on_endpoints_changed(self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
                                   ) -> None:
        """Discovery (gateway/fleet/discovery.py) changed the fleet after `start`: `added` endpoints
        are in their routes now (`endpoint.model.name` names the route), `removed` ones are
        out and marked unhealthy (drop their state). Called on the event loop, between `start`
        and `close`; the default keeps no per-endpoint state, so it does nothing."""
        return None

    def explain(self, request_id: str) -> str | None:
        return None

    async def expected_cached_tokens(self, request: CanonicalRequest,
                                     endpoints: Sequence[Endpoint]) -> int:
        """How many of the request's prompt tokens the chosen endpoint will likely find in its
        prefix cache (admission reserves only the rest against a token limit); 0 when unknown."""
        return 0


class LeastOutstandingRouter(Router):
    """Fewest requests in flight from this gateway; ties go to the shorter predicted queueing
    delay for the request's class (the replica's admission estimate), then the lower reported
    queue."""

    def pick(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        best = min(endpoints, key=lambda endpoint: _load_key(endpoint, request.service_tier))
        return Decision(best, "least_outstanding")


def _load_key(endpoint: Endpoint, service_tier: str | None) -> tuple[int, float, int]:
    load = endpoint.load
    if load is None:
        return endpoint.num_outstanding, 0.0, 0
    return (endpoint.num_outstanding, load.queue_delay_ms(service_tier) or 0.0,
            load.num_requests_waiting or 0)
