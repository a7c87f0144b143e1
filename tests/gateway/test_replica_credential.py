"""The gateway presents its replica secret on every call to a replica (generation, /v1/models,
/metrics, KV events and snapshots, the dashboard's /debug/traces), and a replica that refuses it
is the gateway's failure, never the caller's 401. A real replica app (the fake engine) requiring
a secret, on a real socket."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine.server import ReplicaServerSettings
from engine.server import create_app as create_replica_app
from gateway.dashboard.replicas import fetch
from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.endpoints import Endpoint
from gateway.request.errors import UpstreamUnavailable
from gateway.routing.events_consumer import ReplicaEventConsumer
from gateway.routing.index import InProcessIndex
from gateway.settings import ModelSettings
from gateway.upstream.lean_transport import LeanTransport
from gateway.web.keys import FLEET, TRANSPORT
from tests.engine.server.fakes import FakeEngine
from tests.gateway.conftest import GatewayFactory, LoopThread, start_app, wait_until

SECRET = "replica-secret-for-tests"


@pytest.fixture
def replica(loop_thread: LoopThread) -> Iterator[tuple[FakeEngine, str]]:
    engine = FakeEngine()
    app = create_replica_app(engine, ReplicaServerSettings(secret=SECRET))
    runner, url = loop_thread.run(start_app(app))
    yield engine, url
    loop_thread.run(runner.cleanup())


def _models(url: str, model: str) -> list[dict[str, object]]:
    return [{"name": "m", "upstream_model": model, "backend": "replica", "endpoints": [url]}]


def _chat(gateway_url: str) -> httpx.Response:
    return httpx.post(gateway_url + "/v1/chat/completions", timeout=30, json={
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})


async def _consumer_reads(endpoint: Endpoint) -> int:
    """The KV event consumer's three reads of a replica; how many answered 200 (a refusal
    raises UpstreamUnavailable, naming the status)."""
    transport = LeanTransport()
    try:
        consumer = ReplicaEventConsumer(endpoint, InProcessIndex(), transport)
        for path in ("/v1/models", "/kv/snapshot", "/kv/events?since=0"):
            await consumer._get(path)
    finally:
        await transport.aclose()
    return 3


def test_the_gateway_presents_its_replica_secret_on_every_call(
        make_gateway: GatewayFactory, loop_thread: LoopThread,
        replica: tuple[FakeEngine, str]) -> None:
    engine, url = replica
    gateway = make_gateway(models=_models(url, str(engine.model_config.model_id)),
                           replica_secret=SECRET)
    (endpoint,) = gateway.app[FLEET].routes["m"].endpoints
    assert _chat(gateway.url).status_code == 200
    # /v1/models (context length) and /metrics (load), from the health checker
    assert wait_until(lambda: endpoint.context_length is not None and endpoint.load is not None)
    assert endpoint.context_length == engine.max_model_len

    assert loop_thread.run(_consumer_reads(endpoint)) == 3  # each answered 200
    traces = loop_thread.run(fetch(gateway.app[TRANSPORT],
                                   url + "/debug/traces?trace_id=" + "0" * 32,
                                   1.0, endpoint.auth_headers))
    assert traces is not None


def test_without_the_secret_the_same_calls_are_refused(
        loop_thread: LoopThread, replica: tuple[FakeEngine, str]) -> None:
    _, url = replica
    assert httpx.get(url + "/kv/events?since=0").status_code == 401

    endpoint = Endpoint(url, ModelSettings(name="m", endpoints=(url,)), CircuitBreaker(3, 1.0))
    assert endpoint.auth_headers == {}
    with pytest.raises(UpstreamUnavailable, match="answered 401"):
        loop_thread.run(_consumer_reads(endpoint))


def test_a_replica_refusing_the_gateways_credential_is_a_502_not_the_callers_401(
        make_gateway: GatewayFactory, replica: tuple[FakeEngine, str]) -> None:
    engine, url = replica
    gateway = make_gateway(models=_models(url, str(engine.model_config.model_id)),
                           replica_secret="out-of-step", num_retries=0)
    response = _chat(gateway.url)
    assert response.status_code == 502, response.text
    assert "credential" in response.json()["error"]["message"]
    assert engine.calls == []  # refused before anything ran
