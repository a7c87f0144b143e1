"""Replica discovery: a model's endpoints from DNS, e.g. a Kubernetes headless Service.

    [[models]]
    name = "smollm2"
    discover = "dns://aigw-replica.aigw.svc.cluster.local:8001"   # -> http://<each address>:8001

A headless Service's name resolves to one A/AAAA record per ready pod. `Discovery.refresh()`
resolves the name of every model that sets `discover` and makes the answer that model's endpoint
set (`Fleet.set_endpoints`: endpoints that stay keep their breaker and health), then tells the
router (`Router.on_endpoints_changed`). `run(interval_s)` repeats that every `interval_s`
(the gateway uses `health_interval_s`) and health-checks new endpoints at once.

Resolver contract (the one seam tests replace): `await resolve(host, port)` returns the addresses
(IPv4 or IPv6 strings, any order, duplicates allowed); an empty list means the name does not exist
or has no records (NXDOMAIN: no ready pod), and the model then has no endpoints; raising `OSError`
means the lookup failed (timeout, SERVFAIL), and the model keeps its last known endpoints.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.fleet.endpoints import Endpoint, Fleet
from gateway.fleet.health import check_endpoint
from gateway.routing.base import Router

log = logging.getLogger("aigw.gateway.discovery")

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


@dataclass(frozen=True, slots=True)
class DnsTarget:
    """`dns://host:port`: endpoints are `http://<address>:port` for each address of `host`."""

    host: str
    port: int

    def url_of(self, address: str) -> str:
        return f"http://[{address}]:{self.port}" if ":" in address else f"http://{address}:{self.port}"


def parse_discover(value: str) -> DnsTarget:
    """`dns://<name>:<port>` -> DnsTarget; ValueError for anything else."""
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"discover {value!r}: bad port") from exc
    if parts.scheme != "dns" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"discover must look like 'dns://<name>:<port>', got {value!r}")
    return DnsTarget(parts.hostname, port)


async def resolve_dns(host: str, port: int) -> list[str]:
    """The system resolver (A and AAAA, through the loop's executor: never blocks the loop)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_SUCH_NAME:
            return []
        raise
    return [str(info[4][0]) for info in infos]


class Discovery:
    def __init__(self, fleet: Fleet, router: Router, resolve: Resolver = resolve_dns) -> None:
        self._fleet = fleet
        self._router = router
        self._resolve = resolve
        self._targets = {route.settings.name: parse_discover(route.settings.discover)
                         for route in fleet.routes.values() if route.settings.discover is not None}

    @property
    def is_active(self) -> bool:
        """Does some model discover its endpoints?"""
        return bool(self._targets)

    async def refresh(self, *, notify_router: bool = True) -> list[Endpoint]:
        """Resolve every target once and apply the answers; returns the endpoints added."""
        all_added: list[Endpoint] = []
        all_removed: list[Endpoint] = []
        for model, target in self._targets.items():
            try:
                addresses = await self._resolve(target.host, target.port)
            except OSError as exc:
                log.warning("discovery of %s (%s) failed, keeping its endpoints: %r", model,
                            target.host, exc)
                continue
            urls = tuple(sorted({target.url_of(address) for address in addresses}))
            added, removed = self._fleet.set_endpoints(model, urls)
            if added or removed:
                log.warning("model %s: endpoints %s added, %s removed (now %d)", model,
                            [e.url for e in added], [e.url for e in removed], len(urls))
            all_added += added
            all_removed += removed
        if notify_router and (all_added or all_removed):
            await self._router.on_endpoints_changed(all_added, all_removed)
        return all_added

    async def run(self, interval_s: float, check_timeout_s: float) -> None:
        """Forever: every `interval_s`, refresh and health-check new endpoints; cancel to stop."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                added = await self.refresh()
                if added:
                    await asyncio.wait_for(self._check(added), check_timeout_s)
            except TimeoutError:
                log.warning("health checks of new endpoints took over %.1fs", check_timeout_s)
            except Exception:  # noqa: BLE001 - a discovery bug must not stop discovering
                log.exception("discovery round failed")

    async def _check(self, endpoints: list[Endpoint]) -> None:
        routes = [self._fleet.get(endpoint.model.name) for endpoint in endpoints]
        await asyncio.gather(*(check_endpoint(route, endpoint)
                               for route, endpoint in zip(routes, endpoints, strict=True)
                               if route is not None))
