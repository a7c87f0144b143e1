"""KV event consumers against a replica stand-in that serves the engine's real KVEventLog."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.endpoints import Endpoint
from gateway.routing.events_consumer import ConsumerConfig, ReplicaEventConsumer
from gateway.settings import ModelSettings
from gateway.upstream.lean_transport import LeanTransport
from tests.gateway.routing.conftest import IndexUnderTest


class FakeReplica:
    """/v1/models, /kv/snapshot and /kv/events shaped like engine/server's, over a real log."""

    def __init__(self, replica_id: str = "rep-a", capacity: int = 4) -> None:
        self.log = KVEventLog(replica_id, capacity=capacity)
        self.failing = False

    def store(self, *hashes: int) -> None:
        self.log.record(BlockStored(tuple(hashes), None, (), 16))
        self.log.seal()

    def remove(self, *hashes: int) -> None:
        self.log.record(BlockRemoved(tuple(hashes)))
        self.log.seal()

    def app(self) -> web.Application:
        async def guard(handler: Any, body: Any) -> web.Response:
            return web.Response(status=503) if self.failing else web.json_response(body)

        async def models(_: web.Request) -> web.Response:
            return await guard(None, {"data": [{"id": "alias", "root": "model-x"}]})

        async def snapshot(_: web.Request) -> web.Response:
            return await guard(None, self.log.snapshot(16).to_json())

        async def events(request: web.Request) -> web.Response:
            page = self.log.since(int(request.query["since"]))
            body = page.to_json() if page else {"replica_id": self.log.replica_id,
                                                 "snapshot_required": True,
                                                 "last_seq": self.log.last_seq, "batches": []}
            return await guard(None, body)

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/kv/snapshot", snapshot)
        app.router.add_get("/kv/events", events)
        return app


class Rig:
    def __init__(self, index: IndexUnderTest, replica: FakeReplica) -> None:
        self.ix = index
        self.replica = replica
        self.server = TestServer(replica.app(), host="127.0.0.1")
        index.run(self.server.start_server())
        url = str(self.server.make_url("")).rstrip("/")
        model = ModelSettings(name="m", endpoints=(url,))
        self.endpoint = Endpoint(url, model, CircuitBreaker(3, 1.0))
        self.transport = LeanTransport()
        self.consumer = ReplicaEventConsumer(self.endpoint, index.index, self.transport,
                                             ConsumerConfig(num_failures_to_drop=2))

    def step(self, num_steps: int = 1) -> None:
        for _ in range(num_steps):
            self.ix.run(self.consumer.step())

    def held(self, *hashes: int) -> int:
        return self.ix.run(self.ix.index.match(list(hashes), ["rep-a"]))["rep-a"]

    def close(self) -> None:
        self.ix.run(self.transport.aclose())
        self.ix.run(self.server.close())


@pytest.fixture
def rig(index: IndexUnderTest) -> Any:
    under_test = Rig(index, FakeReplica())
    yield under_test
    under_test.close()


def test_first_step_syncs_from_the_snapshot_then_applies_events(rig: Rig) -> None:
    rig.replica.store(1, 2)
    rig.step()
    assert rig.consumer.is_synced and rig.consumer.replica_id == "rep-a"
    assert rig.consumer.model_id == "model-x" and rig.consumer.block_size == 16
    assert rig.held(1, 2) == 2
    rig.replica.store(3)
    rig.replica.remove(1)
    rig.step()
    assert rig.held(1) == 0 and rig.ix.run(rig.ix.index.match([3], ["rep-a"])) == {"rep-a": 1}
    assert rig.ix.run(rig.ix.index.applied_seq("rep-a")) == 3


def test_falling_behind_the_log_resyncs_from_a_snapshot(rig: Rig) -> None:
    rig.step()
    for h in range(10, 20):  # capacity 4: older batches are gone
        rig.replica.store(h)
    rig.replica.remove(10)
    rig.step()
    assert not rig.consumer.is_synced  # snapshot_required seen
    rig.step()
    assert rig.consumer.is_synced and rig.consumer.num_resyncs == 2
    assert rig.held(11, 12, 13) == 3 and rig.held(10) == 0


def test_a_cleared_cache_and_a_restarted_replica_leave_no_stale_entries(
        rig: Rig, index: IndexUnderTest) -> None:
    rig.replica.store(1, 2)
    rig.step(2)
    rig.replica.log.record(AllBlocksCleared())
    rig.replica.log.seal()
    rig.step()
    assert rig.held(1) == 0
    rig.replica.store(5)
    rig.step()
    rig.replica.log = KVEventLog("rep-a", capacity=4)  # a new process: seq starts again
    rig.replica.store(7)
    rig.step(2)
    assert rig.consumer.num_resyncs == 2
    assert rig.held(5) == 0 and rig.held(7) == 1


def test_failed_polls_or_an_unhealthy_endpoint_drop_the_replica(rig: Rig) -> None:
    rig.replica.store(1)
    rig.step()
    rig.replica.failing = True
    rig.step()
    assert rig.held(1) == 1  # one failure is tolerated
    rig.step()
    assert rig.held(1) == 0 and not rig.consumer.is_synced
    rig.replica.failing = False
    rig.step()
    assert rig.held(1) == 1
    rig.endpoint.is_healthy = False
    rig.step()
    assert rig.held(1) == 0 and rig.ix.run(rig.ix.index.applied_seq("rep-a")) is None


def test_two_consumers_sharing_an_index_apply_each_batch_once(rig: Rig,
                                                              index: IndexUnderTest) -> None:
    other = ReplicaEventConsumer(rig.endpoint, index.index, rig.transport, ConsumerConfig())
    rig.step()
    index.run(other.step())
    rig.replica.store(1)
    rig.replica.store(2)
    rig.replica.remove(1)
    rig.step()
    index.run(other.step())  # sees batches already applied: STALE, no resync
    index.run(other.step())
    assert other.num_resyncs == 1 and rig.consumer.num_resyncs == 1
    assert rig.held(1) == 0 and rig.held(2) == 1


def test_a_replica_that_dies_while_resyncing_is_still_dropped(rig: Rig) -> None:
    rig.replica.store(1)
    rig.step()
    for h in range(10, 16):  # the consumer falls behind: it must re-sync...
        rig.replica.store(h)
    rig.step()
    assert not rig.consumer.is_synced
    rig.replica.failing = True  # ...but the replica is gone before it can
    rig.step(2)
    assert rig.held(1) == 0
