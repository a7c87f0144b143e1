"""Publishing a replica's KV event batches to a Redis stream, off the engine thread.

Layout (the contract with gateway/routing/events_consumer.py; both take the key from
contracts/kv_events.py::stream_key):

    aigw:kv:events:{<replica_id>}   STREAM, one entry per EventBatch, capped with XADD MAXLEN ~ N
        fields: seq     the batch's sequence number (gap-free per replica process)
                epoch   a random id of this replica process: a new one means "restarted, re-sync"
                batch   the batch as JSON (EventBatch.to_json)

The hash tag is the replica id: each replica's stream may live on its own cluster slot.

`publish` is called on the engine thread and never waits on the network: it puts the batch on a
bounded queue; a daemon thread drains it with a synchronous client, pipelining what has piled up.
When the queue is full (`max_queued_batches`, or `max_queued_bytes` of `EventBatch.num_bytes`), or
Redis is unreachable for longer than `give_up_s`, batches are dropped and counted in
`num_dropped`: consumers see a gap in `seq` and re-sync from GET /kv/snapshot.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from typing import Any

import orjson

from contracts.kv_events import EventBatch, stream_key

log = logging.getLogger("aigw.engine.kv_events")
_STOP = object()


class RedisEventPublisher:
    def __init__(self, redis_url: str, replica_id: str, *, max_stream_len: int = 10_000,
                 max_queued_batches: int = 4096, max_queued_bytes: int = 16 * 1024 * 1024,
                 give_up_s: float = 5.0, client: Any = None) -> None:
        # One place builds Redis clients from URLs (plain or `redis+cluster://`), shared with the
        # gateway.
        from infra.redis_client import connect_redis_sync

        self.replica_id = replica_id
        self.stream_key = stream_key(replica_id)
        self.epoch = secrets.token_hex(8)
        self.max_stream_len = max_stream_len
        self.give_up_s = give_up_s
        self.num_published = 0
        self.num_dropped = 0
        self._redis = client or connect_redis_sync(redis_url, socket_timeout=2.0,
                                                   socket_connect_timeout=2.0)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queued_batches)
        self.max_queued_bytes = max_queued_bytes
        self.num_queued_bytes = 0  # of the batches on the queue (written under _bytes_lock)
        self._bytes_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kv-events-redis", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        """Enqueue without blocking; a full queue drops the batch (consumers will re-sync)."""
        num_bytes = batch.num_bytes
        with self._bytes_lock:
            if self.num_queued_bytes + num_bytes > self.max_queued_bytes:
                self.num_dropped += 1
                return
            self.num_queued_bytes += num_bytes
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._dequeued(batch)
            self.num_dropped += 1

    def _dequeued(self, batch: EventBatch) -> None:
        with self._bytes_lock:
            self.num_queued_bytes -= batch.num_bytes

    def close(self, timeout_s: float = 2.0) -> None:
        """Flush what is queued (within `timeout_s`) and stop the thread."""
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._redis.close()

    def _run(self) -> None:
        try:  # entries of an earlier process of this replica would read as a sequence break
            self._redis.delete(self.stream_key)
        except Exception as exc:  # noqa: BLE001 - Redis may come up later
            log.warning("could not reset %s: %s", self.stream_key, exc)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            pending = [item]
            while len(pending) < 256:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._send_dequeued(pending)
                    return
                pending.append(item)
            self._send_dequeued(pending)

    def _send_dequeued(self, batches: list[EventBatch]) -> None:
        for batch in batches:
            self._dequeued(batch)
        self._send(batches)

    def _send(self, batches: list[EventBatch]) -> None:
        deadline = time.monotonic() + self.give_up_s
        delay_s = 0.05
        while True:
            try:
                pipe = self._redis.pipeline(transaction=False)
                for batch in batches:
                    pipe.xadd(self.stream_key, {"seq": batch.seq, "epoch": self.epoch,
                                                "batch": orjson.dumps(batch.to_json())},
                              maxlen=self.max_stream_len, approximate=True)
                pipe.execute()
                self.num_published += len(batches)
                return
            except Exception as exc:  # noqa: BLE001 - any Redis failure: retry, then drop
                if time.monotonic() + delay_s > deadline:
                    self.num_dropped += len(batches)
                    log.warning("dropped %d KV event batches for Redis: %s", len(batches), exc)
                    return
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 1.0)
