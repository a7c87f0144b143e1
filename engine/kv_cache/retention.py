"""RetentionTable: prefix blocks a finished request asked to keep for a while, safe from LRU eviction.

    table.retain(key, owner, blocks, until_s)   # one reference per kept block; supersedes `key`'s last
    table.expire(now_s)                         # drop the entries whose time is up
    table.release(key)                          # drop one entry now

A retention is a reference like a running request's, so the pool cannot evict the blocks while it
lasts; when it ends they go back to the free queue (still cached, evicted in LRU order). Bounds, in
blocks: one owner (a project: the cache salt) keeps at most `max_blocks_per_owner`, all owners
together at most `max_blocks_total`; a retention that does not fit keeps its leading blocks (the
shared head of the prompt) up to the bound. Retaining again under the same key (a session's next
turn) releases the previous entry first, so a session holds one prefix at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from engine.kv_cache.block_pool import BlockPool, KVBlock

RetentionKey = tuple[str, str]  # (owner, session key)


@dataclass
class _Entry:
    owner: str
    blocks: list[KVBlock]  # head first
    expires_at_s: float  # on the caller's clock (time.monotonic in the engine)


class RetentionTable:
    def __init__(self, pool: BlockPool, max_blocks_per_owner: int, max_blocks_total: int) -> None:
        if max_blocks_per_owner < 0 or max_blocks_total < 0:
            raise ValueError("retention bounds must be >= 0 blocks")
        self.pool = pool
        self.max_blocks_per_owner = max_blocks_per_owner
        self.max_blocks_total = max_blocks_total
        self._entries: dict[RetentionKey, _Entry] = {}

    def retain(self, key: RetentionKey, blocks: list[KVBlock], until_s: float) -> int:
        """Keep `blocks` (head first) referenced until `until_s`; returns how many fit the bounds."""
        self.release(key)
        owner = key[0]
        room = min(self.max_blocks_per_owner - self.num_blocks_of(owner),
                   self.max_blocks_total - self.num_blocks)
        kept = blocks[:max(room, 0)]
        if kept:
            self.pool.touch(kept)
            self._entries[key] = _Entry(owner, kept, until_s)
        return len(kept)

    def release(self, key: RetentionKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.pool.free_blocks(reversed(entry.blocks))  # tail first, as a finished request's

    def expire(self, now_s: float) -> None:
        for key in [k for k, e in self._entries.items() if e.expires_at_s <= now_s]:
            self.release(key)

    def release_all(self) -> None:
        for key in list(self._entries):
            self.release(key)

    def num_blocks_of(self, owner: str) -> int:
        return sum(len(e.blocks) for e in self._entries.values() if e.owner == owner)

    @property
    def num_blocks(self) -> int:
        return sum(len(e.blocks) for e in self._entries.values())

    def references(self) -> Iterator[KVBlock]:
        """Every block reference the table holds (for KVCacheManager.check_integrity)."""
        for entry in self._entries.values():
            yield from entry.blocks
