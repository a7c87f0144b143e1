"""Keeping the prefix index current: one background task per replica endpoint.

    ReplicaEventConsumer(endpoint, index, transport, config).run()   # until cancelled

States of one consumer:

    unsynced --GET /v1/models (model id), GET /kv/snapshot--> synced --poll--> apply batches
       ^                                                          |
       +-- gap / snapshot_required / replica restarted / --------+
       +-- endpoint unhealthy or `num_failures_to_drop` failed polls: entries DROPPED first

Polling: GET /kv/events?since=<applied seq in the index> every `poll_interval_s`, or, with a
Redis client, XREAD BLOCK on the replica's stream (engine/kv_cache/redis_publisher.py). The
applied seq is read from the index, so gateways sharing a Redis index each skip what another has
applied already (`ApplyResult.STALE`). The replica id is the one the replica reports (snapshot),
not the endpoint URL. The GETs go through the gateway's one upstream transport
(gateway/upstream/transport.py: the replica backend's), each within `request_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import orjson

from contracts.kv_events import KVSnapshot, batch_from_json, stream_key
from gateway.fleet.endpoints import Endpoint
from gateway.request.errors import UpstreamError, UpstreamUnavailable
from gateway.routing.index import ApplyResult, PrefixIndex
from gateway.upstream.transport import Transport, UpstreamRequest

log = logging.getLogger("aigw.routing.events")


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    poll_interval_s: float = 0.1
    request_timeout_s: float = 2.0
    num_failures_to_drop: int = 2  # consecutive failed polls that drop the replica's entries
    stream_block_ms: int = 1000  # XREAD BLOCK, when reading the Redis stream

    def __post_init__(self) -> None:
        if (self.poll_interval_s <= 0 or self.request_timeout_s <= 0
            or self.num_failures_to_drop < 1):
            raise ValueError(f"invalid {self}")


class _Resync(Exception):
    """The consumer must take a snapshot before it can continue."""


class ReplicaEventConsumer:
    """Public read-only state for the router: `replica_id`, `model_id`, `block_size`,
    `is_synced`."""

    def __init__(self, endpoint: Endpoint, index: PrefixIndex, transport: Transport,
                 config: ConsumerConfig = ConsumerConfig(), stream_client: Any = None) -> None:
        self.endpoint = endpoint
        self.index = index
        self.config = config
        self.replica_id: str | None = None
        self.model_id: str | None = None
        self.block_size: int | None = None
        self.is_synced = False
        self.num_resyncs = 0
        self._transport = transport
        self._stream = stream_client  # redis.asyncio.Redis or None (HTTP polling)
        self._stream_pos = "0-0"
        self._epoch: str | None = None
        self._num_failures = 0
        # entries of this replica may be in the index (since a snapshot)
        self._holds_entries = False

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a consumer bug must not stop consuming
                log.exception("KV event consumer for %s failed a step", self.endpoint.url)
                await self._fail()
            await asyncio.sleep(0 if self._stream is not None and self.is_synced
                                else self.config.poll_interval_s)

    async def step(self) -> None:
        """One round: drop if the endpoint is unhealthy, else (re)sync or apply what is new."""
        if not self.endpoint.is_healthy:
            await self.drop("unhealthy")
            return
        try:
            if not self.is_synced:
                await self._resync()
            elif self._stream is not None:
                await self._read_stream()
            else:
                await self._poll_http()
            self._num_failures = 0
        except _Resync as reason:
            log.info("re-syncing %s: %s", self.endpoint.url, reason)
            self.is_synced = False
        except (UpstreamError, TimeoutError, OSError) as exc:
            log.debug("KV events from %s failed: %s", self.endpoint.url, exc)
            await self._fail()

    async def _fail(self) -> None:
        self._num_failures += 1
        if self._num_failures >= self.config.num_failures_to_drop:
            await self.drop(f"{self._num_failures} failed polls")

    async def drop(self, reason: str) -> None:
        """Forget the replica's entries (once per loss of sync) and re-sync when it is back."""
        if self.replica_id is not None and self._holds_entries:
            log.warning("dropping %s (%s) from the prefix index: %s", self.replica_id,
                        self.endpoint.url, reason)
            await self.index.drop_replica(self.replica_id)
            self._holds_entries = False
        self.is_synced = False

    async def _get(self, path: str) -> Any:
        """The replica's JSON answer to GET `path`; UpstreamError when it does not answer 200,
        TimeoutError past `request_timeout_s`."""
        timeout_s = self.config.request_timeout_s
        request = UpstreamRequest("GET", self.endpoint.url + path,
                                  headers=dict(self.endpoint.auth_headers),
                                  connect_timeout_s=timeout_s)
        async with asyncio.timeout(timeout_s):
            response = await self._transport.send(request)
            try:
                if response.status != 200:
                    raise UpstreamUnavailable(f"GET {path} answered {response.status}")
                body = await response.read()
            except BaseException:
                response.close()
                raise
        response.release()  # (read whole: the connection serves the next poll)
        return orjson.loads(body)

    async def _resync(self) -> None:
        if self.model_id is None:
            models = await self._get("/v1/models")
            entry = models["data"][0]
            self.model_id = str(entry.get("root") or entry["id"])
        data = await self._get("/kv/snapshot")
        snapshot = KVSnapshot(str(data["replica_id"]), int(data["seq"]), int(data["block_size"]),
                              tuple(int(h) for h in data["block_hashes"]),
                              tuple(int(h) for h in data.get("host_block_hashes", ())))
        await self.index.load_snapshot(snapshot)
        self._holds_entries = True
        self.replica_id, self.block_size = snapshot.replica_id, snapshot.block_size
        # the stream is read again from its start: entries up to the snapshot's seq are STALE;
        # the publisher empties the stream when its replica starts, so all are of this process
        self._stream_pos, self._epoch = "0-0", None
        self.is_synced = True
        self.num_resyncs += 1
        log.info("synced %s from a snapshot: %d blocks at seq %d", snapshot.replica_id,
                 len(snapshot.block_hashes), snapshot.seq)

    async def _poll_http(self) -> None:
        assert self.replica_id is not None
        since = await self.index.applied_seq(self.replica_id)
        if since is None:
            raise _Resync("the index holds no sequence for it (dropped elsewhere?)")
        page = await self._get(f"/kv/events?since={since}")
        if page.get("snapshot_required"):
            raise _Resync("events older than the replica keeps")
        if int(page["last_seq"]) < since:
            raise _Resync("the replica restarted")
        for raw in page["batches"]:
            if await self.index.apply(batch_from_json(raw)) is ApplyResult.GAP:
                raise _Resync(f"sequence gap at {raw['seq']}")

    def _key(self) -> str:
        return stream_key(self.replica_id or self.endpoint.name)

    async def _read_stream(self) -> None:
        reply = await self._stream.xread({self._key(): self._stream_pos}, count=512,
                                         block=self.config.stream_block_ms)
        for _key, entries in reply or ():
            for entry_id, fields in entries:
                fields = {_text(k): v for k, v in fields.items()}
                epoch = _text(fields["epoch"])
                if self._epoch is not None and epoch != self._epoch:
                    raise _Resync("the replica restarted (new stream epoch)")
                self._epoch = epoch
                self._stream_pos = _text(entry_id)
                if (await self.index.apply(batch_from_json(orjson.loads(fields["batch"])))
                        is ApplyResult.GAP):
                    raise _Resync("sequence gap in the stream")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
