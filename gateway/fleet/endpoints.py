"""Endpoint state (one upstream URL of one model: health, breaker, load) and the fleet of them.

The pipeline is the only writer of `num_outstanding` and the breaker; the health checker is the
only writer of `is_healthy`, `load` and `context_length` (and `Fleet.set_endpoints`, which marks
an endpoint it removes unhealthy so that in-flight requests holding the old route never retry on
it).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gateway.fleet.breaker import CircuitBreaker
from gateway.settings import GatewaySettings, ModelSettings

if TYPE_CHECKING:
    from gateway.backends.base import Backend
    from gateway.upstream.transport import Transport


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """What an upstream reports about itself (None where it did not say)."""

    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    num_kv_blocks_used: int | None = None
    num_kv_blocks_total: int | None = None
    # service_tier -> the replica's predicted queueing delay for a request of that class (ms;
    # aigw_replica_predicted_queue_delay_ms): the router's load score and admission's estimate
    predicted_queue_delay_ms: Mapping[str, float] | None = None
    prefill_ms_per_token: float | None = None  # the replica's measured prefill cost, if it says

    def queue_delay_ms(self, service_tier: str | None) -> float | None:
        """The predicted queueing delay of a request of `service_tier` (None: "default"), if
        the replica reports one."""
        delays = self.predicted_queue_delay_ms
        return delays.get(service_tier or "default") if delays else None


class Endpoint:
    """`auth_headers`: the credential every call to this upstream carries (the model's `api_key`,
    else for a replica the gateway's replica secret); empty when there is none."""

    def __init__(self, url: str, model: ModelSettings, breaker: CircuitBreaker,
                 credential: str | None = None) -> None:
        self.url = url
        self.model = model
        self.breaker = breaker
        self.auth_headers = {"authorization": f"Bearer {credential}"} if credential else {}
        self.name = url.split("://", 1)[-1]  # host:port, what x-aigw-replica shows
        self.is_healthy = True  # optimistic until the first active check says otherwise
        self.num_failed_checks = 0  # consecutive failed active checks
        self.num_outstanding = 0
        self.load: EndpointLoad | None = None
        self.context_length: int | None = model.context_length

    def can_serve(self, now: float | None = None) -> bool:
        return (self.is_healthy
                and self.breaker.can_attempt(time.monotonic() if now is None else now))

    def __repr__(self) -> str:
        return f"Endpoint({self.url}, healthy={self.is_healthy}, {self.breaker.state.value})"


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """A client-visible model: its settings, the backend that speaks to it, its endpoints."""

    settings: ModelSettings
    backend: Backend
    endpoints: tuple[Endpoint, ...]

    @property
    def context_length(self) -> int | None:
        """The largest context window an endpoint reports (or the configured one), if known."""
        # (C-level iteration: this is read on every request's admission)
        return max(filter(None, map(_context_length_of, self.endpoints)), default=None)


_context_length_of = operator.attrgetter("context_length")


class Fleet:
    """model name -> ModelRoute, one breaker per endpoint, one backend instance per backend kind."""

    def __init__(self, settings: GatewaySettings, transport: Transport) -> None:
        from gateway.backends import get_backend_class

        self._settings = settings
        self._replica_secret = settings.read_replica_secret()  # once: a restart rotates it
        backends: dict[str, Backend] = {}
        self.routes: dict[str, ModelRoute] = {}
        for model in settings.models:
            if model.backend not in backends:
                backends[model.backend] = get_backend_class(model.backend)(transport, settings)
            endpoints = tuple(self._new_endpoint(url, model) for url in model.endpoints)
            self.routes[model.name] = ModelRoute(model, backends[model.backend], endpoints)
        # when each model last had an endpoint that can serve (updated by every health round)
        now = time.monotonic()
        self.servable_at_s = dict.fromkeys(self.routes, now)

    def get(self, model: str) -> ModelRoute | None:
        return self.routes.get(model)

    def set_endpoints(self, model: str, urls: tuple[str, ...]
                      ) -> tuple[list[Endpoint], list[Endpoint]]:
        """Make `urls` the endpoints of `model`; returns (added, removed). Endpoints that stay keep
        their state (breaker, health, load); added ones start optimistic like configured ones;
        removed ones are marked unhealthy. The route is replaced, never mutated, so a request that
        already holds it finishes undisturbed."""
        route = self.routes[model]
        current = {endpoint.url: endpoint for endpoint in route.endpoints}
        wanted = dict.fromkeys(url.rstrip("/") for url in urls)
        added = [self._new_endpoint(url, route.settings) for url in wanted if url not in current]
        removed = [endpoint for url, endpoint in current.items() if url not in wanted]
        if not added and not removed:
            return [], []
        fresh = {endpoint.url: endpoint for endpoint in added}
        endpoints = tuple(current.get(url) or fresh[url] for url in wanted)
        self.routes[model] = replace(route, endpoints=endpoints)
        for endpoint in removed:
            endpoint.is_healthy = False
        return added, removed

    def _new_endpoint(self, url: str, model: ModelSettings) -> Endpoint:
        settings = self._settings
        credential = model.api_key or (self._replica_secret if model.backend == "replica" else None)
        return Endpoint(url, model,
                        CircuitBreaker(settings.num_failures_to_eject, settings.ejection_s),
                        credential)

    def note_servable(self, now: float) -> None:
        """Stamp `servable_at_s` of every model that has an endpoint that can serve now."""
        for name, route in self.routes.items():
            if any(endpoint.can_serve(now) for endpoint in route.endpoints):
                self.servable_at_s[name] = now

    def unservable_for_s(self, name: str, now: float) -> float:
        """How long model `name` has had no endpoint that can serve (0.0 while one can)."""
        if any(endpoint.can_serve(now) for endpoint in self.routes[name].endpoints):
            return 0.0
        return now - self.servable_at_s.get(name, now)

    def all_endpoints(self) -> list[tuple[ModelRoute, Endpoint]]:
        return [(route, endpoint) for route in self.routes.values() for endpoint in route.endpoints]
