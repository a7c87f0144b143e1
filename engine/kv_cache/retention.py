"""RetentionTable: prefix blocks a finished request asked to keep for a while, safe from LRU
eviction.

    table.retain(key, blocks, until_s)   # keep `blocks` (head first); supersedes what it extends
    table.expire(now_s)                  # drop the entries whose time is up
    table.release(key)                   # drop one entry now

A retention is a reference like a running request's, so the pool cannot evict the blocks while it
lasts; when it ends they go back to the free queue (still cached, evicted in LRU order). The table
holds ONE pool reference per distinct block, however many entries name it (sixteen sessions that
share a system prompt keep its blocks once), and counts each block once against the bounds.

Bounds, in distinct blocks: one owner (a project: the cache salt) keeps at most
`max_blocks_per_owner`, all owners together at most `max_blocks_total`; a retention that does not
fit keeps its leading blocks (the shared head of the prompt, already kept blocks cost nothing) up
to the bound.

Demand wins: a waiting request that cannot get blocks releases entries, the soonest to expire first,
until it fits (the scheduler): retention protects a prefix from LRU eviction by other cached
content, never makes a live request wait.

Superseding: retaining again under the same key (a session's next turn) releases that key's
previous entry first; and an entry of the same owner whose last block is among the new blocks is
released too (the new prefix extends it: the next turn of a session that sent no session id).
So a session holds one prefix at a time, and two sessions that share only a head keep both.

Events: each retention records `BlockRetained` (the kept blocks' hashes in the event group, and
the wall-clock time they are kept until), so the gateway's index knows these blocks stay; when
the retention ends nothing is recorded (the blocks stay cached until a `BlockRemoved`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from contracts.kv_events import BlockRetained, KVEventLog
from engine.kv_cache.block_pool import EVENT_GROUP, BlockPool, KVBlock

RetentionKey = tuple[str, str]  # (owner, session key)


@dataclass
class _Entry:
    owner: str
    blocks: list[KVBlock]  # head first
    expires_at_s: float  # on the caller's clock (time.monotonic in the engine)


class RetentionTable:
    def __init__(self, pool: BlockPool, max_blocks_per_owner: int, max_blocks_total: int,
                 event_log: KVEventLog | None = None) -> None:
        if max_blocks_per_owner < 0 or max_blocks_total < 0:
            raise ValueError("retention bounds must be >= 0 blocks")
        self.pool = pool
        self.max_blocks_per_owner = max_blocks_per_owner
        self.max_blocks_total = max_blocks_total
        self._event_log = event_log
        self._entries: dict[RetentionKey, _Entry] = {}
        self._tails: dict[tuple[str, int], RetentionKey] = {}  # (owner, last block id) -> entry
        self._num_entries_of: dict[int, int] = {}  # block id -> entries naming it (>= 1)
        self._num_blocks_of: dict[str, int] = {}  # owner -> distinct blocks it keeps

    def retain(self, key: RetentionKey, blocks: list[KVBlock], until_s: float) -> int:
        """Keep `blocks` (head first) referenced until `until_s`; returns how many are kept."""
        owner = key[0]
        self.release(key)
        for block in blocks:  # entries this prefix extends
            extended = self._tails.get((owner, block.block_id))
            if extended is not None:
                self.release(extended)
        room = min(self.max_blocks_per_owner - self.num_blocks_of(owner),
                   self.max_blocks_total - self.num_blocks)
        kept: list[KVBlock] = []
        for block in blocks:
            is_new = block.block_id not in self._num_entries_of
            if is_new and room <= 0:
                break
            room -= is_new
            kept.append(block)
        if not kept:
            return 0
        fresh = [b for b in kept if b.block_id not in self._num_entries_of]
        self.pool.touch(fresh)
        for block in kept:
            self._num_entries_of[block.block_id] = self._num_entries_of.get(block.block_id, 0) + 1
        self._num_blocks_of[owner] = self.num_blocks_of(owner) + len(fresh)
        self._entries[key] = _Entry(owner, kept, until_s)
        self._tails[(owner, kept[-1].block_id)] = key
        self._record(kept, until_s)
        return len(kept)

    def _record(self, blocks: list[KVBlock], until_s: float) -> None:
        if self._event_log is None:
            return
        hashes = tuple(b.block_hash for b in blocks
                       if b.block_hash is not None and b.group == EVENT_GROUP)
        if hashes:
            until_ts = time.time() + max(0.0, until_s - time.monotonic())
            self._event_log.record(BlockRetained(hashes, round(until_ts, 3)))

    def release(self, key: RetentionKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._tails.pop((entry.owner, entry.blocks[-1].block_id), None)
        unreferenced: list[KVBlock] = []
        for block in entry.blocks:
            count = self._num_entries_of[block.block_id] - 1
            if count:
                self._num_entries_of[block.block_id] = count
            else:
                del self._num_entries_of[block.block_id]
                unreferenced.append(block)
        self._num_blocks_of[entry.owner] -= len(unreferenced)
        if not self._num_blocks_of[entry.owner]:
            del self._num_blocks_of[entry.owner]
        self.pool.free_blocks(reversed(unreferenced))  # tail first, as a finished request's

    def expire(self, now_s: float) -> None:
        if not self._entries:
            return
        for key in [k for k, e in self._entries.items() if e.expires_at_s <= now_s]:
            self.release(key)

    def release_soonest(self) -> bool:
        """Release the entry that expires first; False when the table is empty."""
        if not self._entries:
            return False
        self.release(min(self._entries, key=lambda k: self._entries[k].expires_at_s))
        return True

    def release_all(self) -> None:
        for key in list(self._entries):
            self.release(key)

    def num_blocks_of(self, owner: str) -> int:
        """Distinct blocks `owner` keeps."""
        return self._num_blocks_of.get(owner, 0)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks kept in all."""
        return len(self._num_entries_of)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def references(self) -> Iterator[KVBlock]:
        """Every pool reference the table holds: each distinct block once (for check_integrity)."""
        seen: set[int] = set()
        for entry in self._entries.values():
            for block in entry.blocks:
                if block.block_id not in seen:
                    seen.add(block.block_id)
                    yield block

    def check_integrity(self) -> None:
        """The per-block entry counts and per-owner counts agree with the entries."""
        counts: dict[int, int] = {}
        owners: dict[str, set[int]] = {}
        for key, entry in self._entries.items():
            assert key[0] == entry.owner and entry.blocks, (key, entry)
            assert self._tails[(entry.owner, entry.blocks[-1].block_id)] == key
            for block in entry.blocks:
                counts[block.block_id] = counts.get(block.block_id, 0) + 1
                owners.setdefault(entry.owner, set()).add(block.block_id)
                assert block.ref_cnt >= 1, block
        assert counts == self._num_entries_of, (counts, self._num_entries_of)
        assert {o: len(ids) for o, ids in owners.items()} == self._num_blocks_of
        assert len(self._tails) == len(self._entries)
