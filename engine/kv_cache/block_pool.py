"""BlockPool: the KV block array, the free LRU queue and the hash -> block map. No request
bookkeeping.

Every block is in exactly one of three states:

    used     ref_cnt > 0                          (owned by one or more running requests)
    cached   ref_cnt == 0, block_hash set          (in the free queue, still findable by hash)
    free     ref_cnt == 0, block_hash None         (in the free queue)

The free queue is ordered least-recently-freed first; a new block is taken from its front, and if
that block was cached its hash is dropped then (eviction, with a BlockRemoved event).
`check_integrity()` proves free + cached + used == total and that the map and the queue agree.

KV cache groups (engine/kv_cache/layout.py) share the pool: a block serves one group at a time, and
the map is keyed by (group, hash), since the same prefix has its own block in each group. KV events
speak for group 0 only (the first full-attention group when the model has one): a stored hash means
"group 0 holds this prefix's blocks", and the other groups' stores and evictions emit nothing. A hit
can then be shorter than the events suggest (a window group dropped the prefix's tail), never
longer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog

EVENT_GROUP = 0  # the group whose stores and evictions KV events report

CacheKey = tuple[int, int]  # (group, block hash)


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    group: int = 0  # the group whose hash it holds (meaningful while block_hash is set)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 event_log: KVEventLog | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b)
                                                                  for b in self.blocks)
        self._cached: dict[CacheKey, KVBlock] = {}
        self._event_log = event_log
        # Told of every block handed out, with the (group, hash) it dropped (None: it was free): the
        # host tier copies evicted blocks out before the step overwrites them (host_tier.py).
        self.taken_listener: Callable[[int, CacheKey | None], None] | None = None

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable cached)."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: int, group: int = 0) -> KVBlock | None:
        return self._cached.get((group, block_hash))

    def cached_hashes(self, group: int = EVENT_GROUP) -> list[int]:
        """The hashes one group holds (by default the event group's: what the KV events replay
        to)."""
        return [h for g, h in self._cached if g == group]

    # ---- actions ---------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks off the front of the free queue (ref_cnt becomes 1)."""
        if num_blocks > len(self._free_queue):
            raise ValueError(f"cannot take {num_blocks} blocks, {len(self._free_queue)} free")
        taken: list[KVBlock] = []
        evicted: list[int] = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            old_key: CacheKey | None = None
            if block.block_hash is not None:
                if block.group == EVENT_GROUP:
                    evicted.append(block.block_hash)
                old_key = (block.group, block.block_hash)
                del self._cached[old_key]
                block.block_hash = None
            if self.taken_listener is not None:
                self.taken_listener(block.block_id, old_key)
            block.ref_cnt = 1
            taken.append(block)
        if evicted and self._event_log is not None:
            self._event_log.record(BlockRemoved(tuple(evicted)))
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks (pulling them out of the free queue if
        unreferenced)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock | None]) -> None:
        """Drop one reference from each block; unreferenced ones join the queue IN THE ORDER GIVEN
        (callers pass a request's blocks tail first, so its tail is evicted before its shared
        head)."""
        for block in ordered_blocks:
            if block is None:  # a slot a sliding window already released
                continue
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def cache_full_blocks(self, blocks: Sequence[KVBlock | None], block_hashes: Sequence[int],
                          token_ids: Sequence[int], first_block: int, end_block: int,
                          group: int = 0) -> None:
        """Make blocks [first_block, end_block) of a request's `group` table findable by their
        hashes.

        `blocks`, `block_hashes` and `token_ids` are the request's; the blocks must be full (None
        entries, released by a window, are skipped). A hash that is already cached (another request
        computed the same prefix concurrently) keeps its first block; the duplicate simply stays
        uncached.
        """
        if not self.enable_caching or end_block <= first_block:
            return
        stored: list[int] = []
        for i in range(first_block, end_block):
            block, block_hash = blocks[i], block_hashes[i]
            if block is None or block.block_hash is not None or (group, block_hash) in self._cached:
                continue
            block.block_hash, block.group = block_hash, group
            self._cached[(group, block_hash)] = block
            stored.append(i)
        if stored and self._event_log is not None and group == EVENT_GROUP:
            # Emit contiguous runs, so each event's parent_hash chains to its first block.
            run_start = stored[0]
            for k, i in enumerate(stored):
                last_in_run = k + 1 == len(stored) or stored[k + 1] != i + 1
                if last_in_run:
                    self._emit_stored(block_hashes, token_ids, run_start, i + 1)
                    if k + 1 < len(stored):
                        run_start = stored[k + 1]

    def _emit_stored(self, block_hashes: Sequence[int], token_ids: Sequence[int],
                     start: int, end: int) -> None:
        assert self._event_log is not None
        size = self.block_size
        self._event_log.record(BlockStored(
            block_hashes=tuple(block_hashes[start:end]),
            parent_hash=block_hashes[start - 1] if start > 0 else None,
            token_ids=tuple(token_ids[start * size:end * size]),
            block_size=size,
        ))

    def reset_prefix_cache(self) -> None:
        """Forget every hash (blocks in use stay in use, just no longer shareable)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self._event_log is not None:
            self._event_log.record(AllBlocksCleared())

    def check_integrity(self) -> None:
        """free + cached + used == total, and the queue, the map and the ref counts agree."""
        num_used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        num_in_queue = len(self._free_queue)
        assert num_used + num_in_queue == self.num_blocks, (num_used, num_in_queue, self.num_blocks)
        for block_id, block in self._free_queue.items():
            assert block.block_id == block_id and block.ref_cnt == 0, block
        for (group, block_hash), block in self._cached.items():
            assert (block.block_hash == block_hash
                    and block.group == group), (group, block_hash, block)
        assert sum(1 for b in self.blocks if b.block_hash is not None) == len(self._cached)
        assert all(b.ref_cnt >= 0 for b in self.blocks)
