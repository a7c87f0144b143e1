"""The prefix index: which replica holds which KV block hash, fed by the replicas' KV events.

    apply(batch)         -> ApplyResult   batches must arrive in sequence order per replica
    load_snapshot(snap)                    replace a replica's entries, continue after snap.seq
    drop_replica(id)                       forget a replica (dead, or its event sequence broke)
    match(hashes, ids)   -> {id: n}       longest run of consecutive blocks from the START held
    match_tiers(hashes, ids) -> {id: (n, h)}   the same run, and how many of its blocks only the
                                               replica's host tier holds (a hit there costs a copy)
    insert_tentative(id, hashes, ttl_s)   "this replica is about to hold these" (covers event lag)

Sequence contract: the index stores, per replica, the seq of the last batch applied. `apply` of
seq == applied + 1 applies it; seq <= applied is skipped (another gateway sharing the index
already applied it: all writes are set operations, so replays are harmless); seq > applied + 1
or no applied seq at all answers `GAP` and changes nothing: the caller re-syncs from a snapshot.

Entries written by events are permanent until removed; tentative entries carry an expiry and
never overwrite a permanent one; an event `BlockStored` (or `BlockRetained`: a stored block the
replica keeps from eviction for a while) makes a tentative entry permanent.
Events with medium "host" (contracts/kv_events.py) go to a second set per replica, the blocks its
host tier holds: a run continues through blocks held in either set.
Two implementations: `InProcessIndex` here, `RedisIndex` (gateway/routing/redis_index.py).
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

from contracts.kv_events import (
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockRetained,
    BlockStored,
    EventBatch,
    KVEvent,
    KVSnapshot,
)

PERMANENT = 0.0  # the expiry stored for entries written by events


class ApplyResult(enum.Enum):
    APPLIED = "applied"
    STALE = "stale"  # already applied (by us or another gateway): nothing to do
    GAP = "gap"  # not the next batch, or no snapshot yet: re-sync from a snapshot


class PrefixIndex(ABC):
    """All methods are coroutines (the Redis one does I/O) and safe to call concurrently."""

    @abstractmethod
    async def apply(self, batch: EventBatch) -> ApplyResult: ...

    @abstractmethod
    async def load_snapshot(self, snapshot: KVSnapshot) -> None: ...

    @abstractmethod
    async def drop_replica(self, replica_id: str) -> None: ...

    @abstractmethod
    async def applied_seq(self, replica_id: str) -> int | None:
        """The last batch applied for this replica; None after a drop or before any snapshot."""

    @abstractmethod
    async def match(self, block_hashes: Sequence[int],
                    replica_ids: Sequence[str]) -> dict[str, int]:
        """For each of `replica_ids`: how many blocks from the start it holds without a break."""

    async def match_tiers(self, block_hashes: Sequence[int], replica_ids: Sequence[str]
                          ) -> dict[str, tuple[int, int]]:
        """`match`'s runs, each with how many of its blocks are held in the host tier only."""
        return {r: (n, 0) for r, n in (await self.match(block_hashes, replica_ids)).items()}

    @abstractmethod
    async def insert_tentative(self, replica_id: str, block_hashes: Sequence[int],
                               ttl_s: float) -> None: ...

    @abstractmethod
    async def num_blocks(self, replica_id: str) -> int:
        """Entries held for a replica (permanent and unexpired tentative ones)."""

    async def close(self) -> None:
        return None


class InProcessIndex(PrefixIndex):
    """hash -> {replica_id: expiry (PERMANENT or a time.monotonic() deadline)}, plus per-replica
    hash sets so a replica is dropped in O(its blocks)."""

    def __init__(self) -> None:
        self._holders: dict[int, dict[str, float]] = {}
        self._by_replica: dict[str, set[int]] = {}
        self._applied: dict[str, int] = {}
        self._host_holders: dict[int, set[str]] = {}  # the host tiers': hash -> replicas
        self._host_by_replica: dict[str, set[int]] = {}

    async def apply(self, batch: EventBatch) -> ApplyResult:
        applied = self._applied.get(batch.replica_id)
        if applied is None or batch.seq > applied + 1:
            return ApplyResult.GAP
        if batch.seq <= applied:
            return ApplyResult.STALE
        for event in batch.events:
            self._apply_event(batch.replica_id, event)
        self._applied[batch.replica_id] = batch.seq
        return ApplyResult.APPLIED

    def _apply_event(self, replica_id: str, event: KVEvent) -> None:
        if isinstance(event, BlockStored | BlockRemoved) and event.medium == MEDIUM_HOST:
            if isinstance(event, BlockStored):
                self._add_host(replica_id, event.block_hashes)
            else:
                self._remove_host(replica_id, event.block_hashes)
        elif isinstance(event, BlockStored | BlockRetained):
            self._add(replica_id, event.block_hashes, PERMANENT)
        elif isinstance(event, AllBlocksCleared):
            self._clear(replica_id)
        else:
            held = self._by_replica.get(replica_id, set())
            for block_hash in event.block_hashes:
                held.discard(block_hash)
                holders = self._holders.get(block_hash)
                if holders is not None:
                    holders.pop(replica_id, None)
                    if not holders:
                        del self._holders[block_hash]

    def _add(self, replica_id: str, block_hashes: Sequence[int], expiry: float) -> None:
        held = self._by_replica.setdefault(replica_id, set())
        for block_hash in block_hashes:
            holders = self._holders.setdefault(block_hash, {})
            if expiry == PERMANENT or holders.get(replica_id) != PERMANENT:
                holders[replica_id] = expiry
            held.add(block_hash)

    def _add_host(self, replica_id: str, block_hashes: Sequence[int]) -> None:
        self._host_by_replica.setdefault(replica_id, set()).update(block_hashes)
        for block_hash in block_hashes:
            self._host_holders.setdefault(block_hash, set()).add(replica_id)

    def _remove_host(self, replica_id: str, block_hashes: Sequence[int] | set[int]) -> None:
        held = self._host_by_replica.get(replica_id, set())
        for block_hash in block_hashes:
            held.discard(block_hash)
            holders = self._host_holders.get(block_hash)
            if holders is not None:
                holders.discard(replica_id)
                if not holders:
                    del self._host_holders[block_hash]

    def _clear(self, replica_id: str) -> None:
        for block_hash in self._by_replica.pop(replica_id, set()):
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.pop(replica_id, None)
                if not holders:
                    del self._holders[block_hash]
        self._remove_host(replica_id, self._host_by_replica.pop(replica_id, set()))

    async def load_snapshot(self, snapshot: KVSnapshot) -> None:
        self._clear(snapshot.replica_id)
        self._add(snapshot.replica_id, snapshot.block_hashes, PERMANENT)
        self._add_host(snapshot.replica_id, snapshot.host_block_hashes)
        self._applied[snapshot.replica_id] = snapshot.seq

    async def drop_replica(self, replica_id: str) -> None:
        self._clear(replica_id)
        self._applied.pop(replica_id, None)

    async def applied_seq(self, replica_id: str) -> int | None:
        return self._applied.get(replica_id)

    def _live_holders(self, block_hash: int, now: float) -> set[str]:
        holders = self._holders.get(block_hash)
        if not holders:
            return set()
        return {r for r, expiry in holders.items() if expiry == PERMANENT or expiry > now}

    async def match(self, block_hashes: Sequence[int],
                    replica_ids: Sequence[str]) -> dict[str, int]:
        return self.match_now(block_hashes, replica_ids)

    def match_now(self, block_hashes: Sequence[int], replica_ids: Sequence[str]) -> dict[str, int]:
        """`match` without awaiting (the in-process index needs no I/O)."""
        return {r: run for r, (run, _) in self.match_tiers_now(block_hashes, replica_ids).items()}

    async def match_tiers(self, block_hashes: Sequence[int], replica_ids: Sequence[str]
                          ) -> dict[str, tuple[int, int]]:
        return self.match_tiers_now(block_hashes, replica_ids)

    def match_tiers_now(self, block_hashes: Sequence[int], replica_ids: Sequence[str]
                        ) -> dict[str, tuple[int, int]]:
        now = time.monotonic()
        runs = dict.fromkeys(replica_ids, 0)
        host_only = dict.fromkeys(replica_ids, 0)
        alive = set(replica_ids)
        for position, block_hash in enumerate(block_hashes):
            main = self._live_holders(block_hash, now)
            host = self._host_holders.get(block_hash, set())
            alive &= main | host
            if not alive:
                break
            for replica_id in alive:
                runs[replica_id] = position + 1
                if replica_id not in main:
                    host_only[replica_id] += 1
        return {r: (runs[r], host_only[r]) for r in replica_ids}

    async def insert_tentative(self, replica_id: str, block_hashes: Sequence[int],
                               ttl_s: float) -> None:
        self._add(replica_id, block_hashes, time.monotonic() + ttl_s)

    async def num_blocks(self, replica_id: str) -> int:
        now = time.monotonic()
        return sum(1 for h in self._by_replica.get(replica_id, ())
                   if replica_id in self._live_holders(h, now))
