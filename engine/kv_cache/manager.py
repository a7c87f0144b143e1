"""KVCacheManager: which blocks each request holds. The scheduler's only door to the KV cache.

    computed = manager.get_computed_blocks(request)           # prefix-cache hits (no reference taken yet)
    blocks = manager.allocate_slots(request, n, computed)     # None: not enough blocks (preempt and retry)
    manager.free(request)                                      # on finish, abort or preemption
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.events import KVEventLog
from engine.request import Request


@dataclass(frozen=True)
class ComputedBlocks:
    blocks: tuple[KVBlock, ...] = ()
    num_computed_tokens: int = 0


@dataclass
class _RequestBlocks:
    blocks: list[KVBlock] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the hash map


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 event_log: KVEventLog | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, block_size, enable_caching, event_log)
        self._requests: dict[str, _RequestBlocks] = {}
        self.num_queried_tokens = 0  # prefix-cache statistics (prompt tokens looked up / found)
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._requests[request_id].blocks]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest run of cached blocks that starts the request. At least the last token is left to
        compute (its logits are needed), so a fully cached prompt still recomputes its final token."""
        if not self.enable_caching or request.wants_prompt_logprobs:
            return ComputedBlocks()  # (prompt logprobs need every position's logits)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(tuple(hits), len(hits) * self.block_size)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not the scheduler's look-aheads) in the hit statistics."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks = ComputedBlocks()) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones; take references on the
        cache hits. Returns the request's whole block table, or None (nothing changed) if blocks ran out."""
        entry = self._requests.get(request.request_id)
        num_held = len(entry.blocks) if entry else 0
        num_total_tokens = request.num_computed_tokens + computed.num_computed_tokens + num_new_tokens
        num_new_blocks = self.num_blocks_needed(num_total_tokens) - num_held - len(computed.blocks)
        # Cache hits that nobody references sit in the free queue: touching them uses up free blocks.
        num_evictable_hits = sum(1 for b in computed.blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) > self.pool.num_free_blocks - num_evictable_hits:
            return None
        if entry is None:
            entry = self._requests[request.request_id] = _RequestBlocks()
        self.pool.touch(computed.blocks)
        entry.blocks.extend(computed.blocks)
        entry.num_cached_blocks += len(computed.blocks)
        if num_new_blocks > 0:
            entry.blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        self._cache_full_blocks(request, entry, num_total_tokens)
        return [b.block_id for b in entry.blocks]

    def _cache_full_blocks(self, request: Request, entry: _RequestBlocks, num_tokens: int) -> None:
        """Register blocks that will be full once this step's tokens are written (shareable at once)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full > entry.num_cached_blocks:
            self.pool.cache_full_blocks(entry.blocks, request.block_hashes, request.all_token_ids,
                                        entry.num_cached_blocks, num_full)
            entry.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first (so the tail is evicted before the shared head)."""
        entry = self._requests.pop(request.request_id, None)
        if entry is not None:
            self.pool.free_blocks(reversed(entry.blocks))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        for entry in self._requests.values():
            entry.num_cached_blocks = len(entry.blocks)  # never re-register blocks of running requests

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for entry in self._requests.values():
            for block in entry.blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (block, refs.get(block.block_id, 0))

    @property
    def num_requests(self) -> int:
        return len(self._requests)
