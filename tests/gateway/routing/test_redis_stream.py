"""The replica-side Redis stream publisher and the gateway consumer reading the stream."""

from __future__ import annotations

import time

import redis
import redis.asyncio

from contracts.kv_events import BlockStored, KVEventLog, stream_key
from engine.kv_cache.redis_publisher import RedisEventPublisher
from gateway.routing.events_consumer import ConsumerConfig, ReplicaEventConsumer
from tests.gateway.routing.conftest import IndexUnderTest
from tests.gateway.routing.test_events_consumer import FakeReplica, Rig


def wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def test_batches_land_in_the_replicas_stream_in_order(clean_redis_url: str) -> None:
    publisher = RedisEventPublisher(clean_redis_url, "rep-a", max_stream_len=100)
    log = KVEventLog("rep-a", publishers=(publisher,))
    for h in range(5):
        log.record(BlockStored((h,), None, (), 16))
        log.seal()
    wait_for(lambda: publisher.num_published == 5)
    publisher.close()
    entries = redis.Redis.from_url(clean_redis_url).xrange(stream_key("rep-a"))
    assert [int(fields[b"seq"]) for _, fields in entries] == [1, 2, 3, 4, 5]
    assert {fields[b"epoch"] for _, fields in entries} == {publisher.epoch.encode()}


def test_publish_never_waits_when_redis_is_down() -> None:
    publisher = RedisEventPublisher("redis://127.0.0.1:1/0", "rep-a", max_queued_batches=2,
                                    give_up_s=0.2)
    log = KVEventLog("rep-a", publishers=(publisher,))
    started = time.monotonic()
    for h in range(50):
        log.record(BlockStored((h,), None, (), 16))
        log.seal()
    assert time.monotonic() - started < 1.0
    wait_for(lambda: publisher.num_dropped == 50)
    assert publisher.num_dropped == 50 and publisher.num_published == 0
    publisher.close()


def test_the_publish_queue_is_bounded_in_bytes_and_drops_what_would_pass_the_bound() -> None:
    """A step that evicts thousands of blocks makes one large batch: the queue's bound is its
    bytes, not only its count, while Redis is away."""
    publisher = RedisEventPublisher("redis://127.0.0.1:1/0", "rep-a", give_up_s=30,
                                    max_queued_bytes=64 * 1024)
    log = KVEventLog("rep-a", publishers=(publisher,))
    for step in range(8):
        log.record(BlockStored(tuple(range(step * 1000, step * 1000 + 500)), None, (), 16))
        log.seal()
    assert 0 < publisher.num_queued_bytes <= 64 * 1024
    assert publisher.num_dropped >= 4  # ~22 KB a batch: two or three fit (one may be in flight)


def test_the_stream_consumer_applies_published_batches_and_resyncs_on_restart(
        clean_redis_url: str) -> None:
    index = IndexUnderTest("in_process", None)
    replica = FakeReplica()
    publisher = RedisEventPublisher(clean_redis_url, "rep-a")
    replica.log = KVEventLog("rep-a", publishers=(publisher,))
    rig = Rig(index, replica)
    client = redis.asyncio.Redis.from_url(clean_redis_url)
    rig.consumer = ReplicaEventConsumer(rig.endpoint, index.index, rig.transport,
                                        ConsumerConfig(stream_block_ms=50), stream_client=client)
    try:
        replica.store(1)
        wait_for(lambda: publisher.num_published == 1)
        rig.step()  # snapshot
        replica.store(2)
        replica.remove(1)
        wait_for(lambda: publisher.num_published == 3)
        rig.step()
        assert rig.held(1) == 0 and index.run(index.index.match([2], ["rep-a"])) == {"rep-a": 1}
        publisher.close()
        restarted = RedisEventPublisher(clean_redis_url, "rep-a")  # a new process: new epoch
        replica.log = KVEventLog("rep-a", publishers=(restarted,))
        replica.store(9)
        wait_for(lambda: restarted.num_published == 1)
        rig.step(3)
        assert rig.consumer.num_resyncs == 2 and rig.held(9) == 1 and rig.held(2) == 0
        restarted.close()
    finally:
        index.run(client.aclose())
        rig.close()
        index.close()
