"""Replica discovery from DNS (gateway/fleet/discovery.py). DNS is the one faked part: a resolver
function maps names to loopback addresses where real mock upstreams listen on the same port."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web
from pydantic import ValidationError

from bench.mock_upstream import MockConfig, MockState, create_mock_app
from gateway.fleet.breaker import BreakerState
from gateway.fleet.discovery import DnsTarget, parse_discover
from gateway.fleet.endpoints import Endpoint, Fleet
from gateway.routing.base import LeastOutstandingRouter
from gateway.settings import GatewaySettings, ModelSettings
from gateway.upstream.transport import MockTransport
from gateway.web.app import create_app
from tests.gateway.conftest import MODEL, LoopThread, start_app

NAME = "replicas.aigw.test"
BODY = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def test_discover_must_be_a_dns_name_with_a_port() -> None:
    assert parse_discover("dns://aigw-replica.aigw.svc.cluster.local:8001") == DnsTarget(
        "aigw-replica.aigw.svc.cluster.local", 8001)
    for bad in ("http://host:8001", "dns://host", "dns://:8001", "dns://host:8001/path", "dns://h:x"):
        with pytest.raises(ValueError):
            parse_discover(bad)
    assert DnsTarget("h", 8001).url_of("fd00::1") == "http://[fd00::1]:8001"


def test_a_model_needs_endpoints_or_discover() -> None:
    with pytest.raises(ValidationError, match="endpoints.*discover"):
        ModelSettings(name="m")
    with pytest.raises(ValidationError, match="dns://"):
        ModelSettings(name="m", discover="https://host:1")
    assert ModelSettings(name="m", discover="dns://host:1").endpoints == ()


def _fleet(*urls: str) -> Fleet:
    async def unused(request: object) -> object:
        raise AssertionError("no upstream call expected")

    settings = GatewaySettings(models=[{"name": MODEL, "endpoints": list(urls)}])
    return Fleet(settings, MockTransport(unused))  # type: ignore[arg-type]


def test_set_endpoints_keeps_survivors_state_and_marks_the_removed_unhealthy() -> None:
    fleet = _fleet("http://10.0.0.1:8001", "http://10.0.0.2:8001")
    survivor, leaving = fleet.routes[MODEL].endpoints
    survivor.breaker.record_failure(0.0)
    old_route = fleet.routes[MODEL]
    added, removed = fleet.set_endpoints(MODEL, ("http://10.0.0.1:8001", "http://10.0.0.3:8001/"))
    assert [e.url for e in added] == ["http://10.0.0.3:8001"] and removed == [leaving]
    route = fleet.routes[MODEL]
    assert route is not old_route and old_route.endpoints == (survivor, leaving)  # in-flight copy
    assert route.endpoints[0] is survivor and survivor.breaker.num_consecutive_failures == 1
    assert not leaving.is_healthy and route.endpoints[1].is_healthy
    assert route.endpoints[1].breaker.state is BreakerState.CLOSED
    assert fleet.set_endpoints(MODEL, ("http://10.0.0.3:8001", "http://10.0.0.1:8001")) == ([], [])


@dataclass
class FakeDns:
    """name -> addresses; `failing` makes every lookup raise like a DNS timeout."""

    records: dict[str, list[str]] = field(default_factory=dict)
    failing: bool = False

    async def __call__(self, host: str, port: int) -> list[str]:
        if self.failing:
            raise OSError("DNS timeout")
        return list(self.records.get(host, []))


class RecordingRouter(LeastOutstandingRouter):
    def __init__(self) -> None:
        self.changes: list[tuple[list[str], list[str]]] = []

    async def on_endpoints_changed(self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
                                   ) -> None:
        self.changes.append(([e.url for e in added], [e.url for e in removed]))


@dataclass
class Cluster:
    url: str  # the gateway
    port: int  # every upstream's port
    upstreams: dict[str, MockState]  # loopback address -> its mock upstream
    dns: FakeDns
    router: RecordingRouter


@pytest.fixture
def cluster(loop_thread: LoopThread) -> Iterator[Cluster]:
    runners: list[web.AppRunner] = []
    first = MockState(MockConfig())
    runner, url = loop_thread.run(start_app(create_mock_app(first)))
    runners.append(runner)
    port = int(url.rsplit(":", 1)[1])
    second = MockState(MockConfig())  # same port on another loopback address
    runner = web.AppRunner(create_mock_app(second), access_log=None)
    loop_thread.run(runner.setup())
    runners.append(runner)
    loop_thread.run(web.TCPSite(runner, "127.0.0.2", port).start())
    dns = FakeDns({NAME: ["127.0.0.1"]})
    router = RecordingRouter()
    settings = GatewaySettings(auth_enabled=False, health_interval_s=0.05, health_timeout_s=1.0,
                               first_token_timeout_s=2.0, idle_timeout_s=2.0,
                               models=[{"name": MODEL, "discover": f"dns://{NAME}:{port}"}])
    gateway_runner, gateway_url = loop_thread.run(start_app(create_app(settings, router=router,
                                                                       resolve=dns)))
    runners.append(gateway_runner)
    yield Cluster(gateway_url, port, {"127.0.0.1": first, "127.0.0.2": second}, dns, router)
    for runner in reversed(runners):
        loop_thread.run(runner.cleanup())


def _num_endpoints(cluster: Cluster) -> int:
    return httpx.get(cluster.url + "/health").json()["models"][MODEL]["num_endpoints"]


def _wait_for_num_endpoints(cluster: Cluster, num: int) -> None:
    deadline = time.monotonic() + 10
    while _num_endpoints(cluster) != num and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _num_endpoints(cluster) == num


def _served_by(cluster: Cluster) -> str:
    response = httpx.post(cluster.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert response.status_code == 200, response.text
    return response.headers["x-aigw-replica"]


def test_discovered_endpoints_serve_from_the_first_request(cluster: Cluster) -> None:
    assert _num_endpoints(cluster) == 1
    assert _served_by(cluster) == f"127.0.0.1:{cluster.port}"
    assert cluster.router.changes == []  # the router's start() saw the first round's endpoints


def test_endpoints_appear_and_disappear_and_removed_ones_get_no_traffic(cluster: Cluster) -> None:
    first, second = cluster.upstreams["127.0.0.1"], cluster.upstreams["127.0.0.2"]
    cluster.dns.records[NAME] = ["127.0.0.2", "127.0.0.1", "127.0.0.2"]
    _wait_for_num_endpoints(cluster, 2)
    cluster.dns.records[NAME] = ["127.0.0.2"]
    _wait_for_num_endpoints(cluster, 1)
    num_first = len(first.request_ids)
    assert {_served_by(cluster) for _ in range(5)} == {f"127.0.0.2:{cluster.port}"}
    assert len(first.request_ids) == num_first and len(second.request_ids) == 5
    url_of = f"http://127.0.0.{{}}:{cluster.port}".format
    assert cluster.router.changes[:2] == [([url_of(2)], []), ([], [url_of(1)])]


def test_a_failed_lookup_keeps_the_endpoints_and_no_records_removes_them(cluster: Cluster) -> None:
    cluster.dns.failing = True
    time.sleep(0.3)  # several rounds
    assert _num_endpoints(cluster) == 1 and _served_by(cluster) == f"127.0.0.1:{cluster.port}"
    cluster.dns.failing = False
    cluster.dns.records[NAME] = []  # NXDOMAIN: no ready pod
    _wait_for_num_endpoints(cluster, 0)
    response = httpx.post(cluster.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert response.status_code == 503
