"""KV events: what a replica's prefix cache stores and drops, for the gateway's prefix index.

The records (one module, imported by the engine that emits them and the gateway that consumes them):

    BlockStored     {block_hashes, parent_hash, token_ids, block_size}   blocks became cached (full,
                                                                         hashed)
    BlockRemoved    {block_hashes}                                        blocks were evicted
    AllBlocksCleared {}                                                   the whole cache was reset
    BlockRetained   {block_hashes, retained_until_ts}                     cached blocks a finished
                                                                          request keeps from
                                                                          eviction until then (unix
                                                                          s; a later event for the
                                                                          same hashes replaces it)

`BlockRetained` names blocks already stored (the replica's KV retention,
engine/kv_cache/retention.py): a consumer counts them as held, like `BlockStored`; no event marks a
retention's end, since the blocks stay cached until a `BlockRemoved` says otherwise.

`medium` on BlockStored / BlockRemoved says which tier: "main" (the KV pool the model reads; the
default, and what an event without the field means) or "host" (the replica's second tier, where
blocks evicted from the pool wait to be restored instead of recomputed:
engine/kv_cache/host_tier.py). The tiers are two sets: a block moving out of the pool is a
BlockRemoved "main" plus a BlockStored "host" in the same batch; a block restored into the pool
stays in the host tier too (BlockStored "main" only). A consumer that routes on hits counts a hash
held in either.

Events are grouped into an `EventBatch` per engine step, stamped with the replica id and a sequence
number that increases by exactly one per batch (no gaps). A consumer that sees a gap, or restarts,
asks for a snapshot (`KVSnapshot`: every hash the replica holds now, with the sequence number it is
valid at) and continues from there. JSON form: `{"type": "BlockStored", ...}` dicts inside
`{"replica_id", "seq", "ts", "events": [...]}`.

`token_ids` is empty: the log drops them as events are recorded, so neither GET /kv/events nor the
Redis stream carries any tenant's prompt (the gateway's index needs the hashes alone). A log made
with `include_token_ids=True` (`aigw replica --kv-events-token-ids`, for debugging) keeps them.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = "main"  # MEDIUM_MAIN: the KV pool; MEDIUM_HOST: the replica's second tier
    type: str = "BlockStored"


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str = "main"
    type: str = "BlockRemoved"


@dataclass(frozen=True)
class AllBlocksCleared:
    type: str = "AllBlocksCleared"


@dataclass(frozen=True)
class BlockRetained:
    block_hashes: tuple[int, ...]
    retained_until_ts: float  # unix seconds
    type: str = "BlockRetained"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | BlockRetained

MEDIUM_MAIN = "main"  # the KV pool the model reads (GPU memory, or host memory on a CPU replica)
# the second tier blocks evicted from the pool go to (engine/kv_cache/host_tier.py)
MEDIUM_HOST = "host"
MEDIA = (MEDIUM_MAIN, MEDIUM_HOST)


@dataclass(frozen=True)
class EventBatch:
    replica_id: str
    seq: int
    ts: float
    events: tuple[KVEvent, ...]

    def to_json(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "seq": self.seq, "ts": self.ts,
                "events": [asdict(e) for e in self.events]}

    @functools.cached_property
    def num_bytes(self) -> int:
        """An upper bound of the bytes the batch holds in CPython: what the log's and the
        publisher's byte budgets count (a step's batch has one event per stored or evicted run of
        blocks, so its size follows the step, not a fixed count)."""
        num_ids = sum(len(getattr(e, "block_hashes", ())) + len(getattr(e, "token_ids", ()))
                      for e in self.events)
        return _BATCH_BYTES + _EVENT_BYTES * len(self.events) + _ID_BYTES * num_ids


# CPython sizes, rounded up: a batch (object, tuple, str, float), an event (a frozen dataclass
# and its tuples), and one id in a tuple (a pointer and an int of up to 64 bits)
_BATCH_BYTES, _EVENT_BYTES, _ID_BYTES = 256, 192, 44


def event_from_json(data: dict[str, Any]) -> KVEvent:
    kind = data.get("type")
    if kind == "BlockStored":
        return BlockStored(tuple(data["block_hashes"]), data.get("parent_hash"),
                           tuple(data.get("token_ids", ())), int(data["block_size"]),
                           _medium(data))
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(data["block_hashes"]), _medium(data))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if kind == "BlockRetained":
        return BlockRetained(tuple(data["block_hashes"]), float(data["retained_until_ts"]))
    raise ValueError(f"unknown KV event type {kind!r}")


def _medium(data: dict[str, Any]) -> str:
    medium = data.get("medium", MEDIUM_MAIN)
    if medium not in MEDIA:
        raise ValueError(f"unknown KV event medium {medium!r}")
    return str(medium)


def batch_from_json(data: dict[str, Any]) -> EventBatch:
    return EventBatch(str(data["replica_id"]), int(data["seq"]), float(data["ts"]),
                      tuple(event_from_json(e) for e in data["events"]))


def apply_events(held: set[int], events: tuple[KVEvent, ...] | list[KVEvent],
                 host_held: set[int] | None = None) -> None:
    """Replay events onto a set of held hashes (what a consumer of the stream does): `held` is the
    main pool's, `host_held` (when given) the second tier's; AllBlocksCleared empties both."""
    for event in events:
        if isinstance(event, BlockStored | BlockRemoved) and event.medium == MEDIUM_HOST:
            if host_held is not None:
                if isinstance(event, BlockStored):
                    host_held.update(event.block_hashes)
                else:
                    host_held.difference_update(event.block_hashes)
        elif isinstance(event, BlockStored | BlockRetained):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
        else:
            held.clear()
            if host_held is not None:
                host_held.clear()


@dataclass(frozen=True)
class KVSnapshot:
    replica_id: str
    seq: int  # the snapshot includes every batch up to and including this one
    block_size: int
    block_hashes: tuple[int, ...]
    host_block_hashes: tuple[int, ...] = ()  # held in the second tier (a hash may be in both)

    def to_json(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "seq": self.seq, "block_size": self.block_size,
                "block_hashes": list(self.block_hashes),
                "host_block_hashes": list(self.host_block_hashes)}


class EventPublisher(Protocol):
    """Somewhere batches go besides the in-memory log (e.g. a Redis stream). Must not block for
    long."""

    def publish(self, batch: EventBatch) -> None: ...


@dataclass
class EventPage:
    replica_id: str
    first_seq: int  # oldest batch still held; a consumer asking for older must take a snapshot
    last_seq: int
    batches: list[EventBatch] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "first_seq": self.first_seq,
                "last_seq": self.last_seq,
                "snapshot_required": False, "batches": [b.to_json() for b in self.batches]}


class KVEventLog:
    """Collects events during a step, seals them into numbered batches, keeps the last `capacity`
    batches and at most `max_bytes` of them (`EventBatch.num_bytes`; the newest is always kept).
    A consumer further behind than what is kept re-syncs from a snapshot.

    Written by the engine thread, read by the server's event loop: guarded by a lock.
    """

    def __init__(self, replica_id: str, capacity: int = 4096,
                 publishers: tuple[EventPublisher, ...] = (), include_token_ids: bool = False,
                 max_bytes: int = 16 * 1024 * 1024) -> None:
        self.replica_id = replica_id
        self.include_token_ids = include_token_ids
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0  # of the kept batches
        self._pending: list[KVEvent] = []
        self._batches: deque[EventBatch] = deque()
        self._last_seq = 0  # batch numbers start at 1; 0 = "nothing yet"
        self._publishers = publishers
        self._held: set[int] = set()  # hashes held as of the last sealed batch (the snapshot)
        self._held_host: set[int] = set()  # the same for the second tier
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    def record(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored) and event.token_ids and not self.include_token_ids:
            event = replace(event, token_ids=())
        self._pending.append(event)

    def seal(self) -> EventBatch | None:
        """Close the current step's events into one batch (no batch for a step without events)."""
        if not self._pending:
            return None
        with self._cond:
            self._last_seq += 1
            batch = EventBatch(self.replica_id, self._last_seq, time.time(), tuple(self._pending))
            self._pending = []
            apply_events(self._held, batch.events, self._held_host)
            batches = self._batches
            batches.append(batch)
            self.num_bytes += batch.num_bytes
            while len(batches) > 1 and (len(batches) > self.capacity
                                        or self.num_bytes > self.max_bytes):
                self.num_bytes -= batches.popleft().num_bytes
            self._cond.notify_all()
        for publisher in self._publishers:
            publisher.publish(batch)
        return batch

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def snapshot(self, block_size: int) -> KVSnapshot:
        """Every hash held as of the last sealed batch; safe to call from any thread."""
        with self._lock:
            return KVSnapshot(self.replica_id, self._last_seq, block_size, tuple(self._held),
                              tuple(self._held_host))

    def num_leading_held(self, block_hashes: Sequence[int]) -> int:
        """How many of `block_hashes`, from the first, are held (in the pool or the second tier)
        as of the last sealed batch; safe to call from any thread."""
        with self._lock:
            for i, block_hash in enumerate(block_hashes):
                if block_hash not in self._held and block_hash not in self._held_host:
                    return i
            return len(block_hashes)

    def since(self, seq: int) -> EventPage | None:
        """Batches with number > seq, or None when some of them are no longer held (take a
        snapshot)."""
        with self._lock:
            first = self._batches[0].seq if self._batches else self._last_seq + 1
            if seq + 1 < first and seq < self._last_seq:
                return None
            batches = [b for b in self._batches if b.seq > seq]
            return EventPage(self.replica_id, first, self._last_seq, batches)

    def wait_for(self, seq: int, timeout_s: float) -> None:
        """Block until a batch newer than `seq` exists or the timeout passes (for long-polling)."""
        with self._cond:
            self._cond.wait_for(lambda: self._last_seq > seq, timeout=timeout_s)


def stream_key(replica_id: str, prefix: str = "aigw") -> str:
    """The Redis stream a replica publishes its batches to (engine/kv_cache/redis_publisher.py)
    and the gateway reads (gateway/routing/events_consumer.py); the replica id is the hash tag,
    so each replica's stream may live on its own cluster slot."""
    return f"{prefix}:kv:events:{{{replica_id}}}"
