"""KVCacheManager: which blocks each request holds. The scheduler's only door to the KV cache.

    computed = manager.get_computed_blocks(request)  # prefix-cache hits (no reference taken yet)
    tables = manager.allocate_slots(request, n, computed)  # None: too few blocks (preempt, retry)
    manager.free(request)  # on finish, abort or preemption

A request holds one block table per KV cache group (engine/kv_cache/layout.py). A full-attention
group keeps a block for every `block_size` tokens. A sliding-window group (window W) keeps only the
blocks the next token to compute can see: when the request's next position is p, blocks wholly
before p - W + 1 are released to the pool (their table entries become None) as the window moves, so
a sequence holds about (W + chunk) / block_size blocks there, whatever its length:

    window group, W = 40, block_size 16, next position p = 70 (sees 31..70):
        table  [None, b1, b2, b3, b4]        block 0 (positions 0..15) released; b1 (16..31) still
                                             seen

Prefix hits across groups: a hit of k blocks (N = k * block_size tokens) needs every full group's
blocks 0..k-1 cached, and each window group's blocks covering positions N - W + 1 .. N - 1 (the ones
the first computed token sees). `get_computed_blocks` takes the longest k that every group can
serve; the hit's window-group tables start with None for blocks no token will read.

Chunked local attention of chunk C (Llama 4's RoPE layers) is the other local kind, at the same two
places: what a token at position p can still see (`_first_needed_block`: floor(p / C) * C .. p) and
what a hit needs (the same rule at p = N). Its group releases a chunk's blocks once p enters the
next chunk, and a hit of N tokens needs blocks from floor(N / C) * C on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.kv_events import KVEventLog
from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.host_tier import HostTier, KVTransfers, TierHit
from engine.kv_cache.retention import RetentionTable
from engine.request import Request

BlockTable = list[int | None]  # block ids of one group, None where a window released the block


@dataclass(frozen=True)
class ComputedBlocks:
    # per group; () = no hit. TierHit: served by the host tier (restored into a fresh block)
    blocks: tuple[tuple[KVBlock | TierHit | None, ...], ...] = ()
    num_computed_tokens: int = 0
    num_host_tokens: int = 0  # of them, in blocks group 0 restores from the host tier


@dataclass
class _GroupBlocks:
    blocks: list[KVBlock | None] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading entries already registered in the hash map (or released)
    first_live: int = 0  # entries before it are None: released by the window (0 in full groups)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 event_log: KVEventLog | None = None,
                 group_windows: tuple[int | None, ...] = (None,),
                 group_chunks: tuple[int | None, ...] | None = None,
                 retention_share_per_owner: float = 0.25, retention_share_total: float = 0.5,
                 host_tier: HostTier | None = None) -> None:
        """`group_windows`: each KV cache group's sliding window (None: full attention).
        `group_chunks`: each group's attention chunk (None: none; a group has a window or a chunk).
        `retention_share_*`: the fractions of the pool that retained prefixes may hold, per owner
        (cache salt) and in all (engine/kv_cache/retention.py). `host_tier`: where evicted blocks
        go and prefix hits continue (engine/kv_cache/host_tier.py); None: evicted blocks are
        gone."""
        if not group_windows or any(w is not None and w < 1 for w in group_windows):
            raise ValueError("group_windows must name at least one group, windows >= 1: "
                             f"{group_windows}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = group_windows
        self.group_chunks = (group_chunks if group_chunks is not None
                             else (None,) * len(group_windows))
        if (len(self.group_chunks) != len(group_windows)
                or any(c is not None and c < 1 for c in self.group_chunks)
                or any(w is not None and c is not None
                       for w, c in zip(group_windows, self.group_chunks, strict=True))):
            raise ValueError(f"group_chunks must match group_windows, chunks >= 1: {group_chunks}")
        self.pool = BlockPool(num_blocks, block_size, enable_caching, event_log)
        self._requests: dict[str, list[_GroupBlocks]] = {}
        self.retention = RetentionTable(self.pool, int(num_blocks * retention_share_per_owner),
                                        int(num_blocks * retention_share_total), event_log)
        self.num_queried_tokens = 0  # prefix-cache statistics (prompt tokens looked up / found)
        self.num_hit_tokens = 0
        self.num_host_hit_tokens = 0  # of the hit tokens, those the host tier served
        self.host_tier = host_tier if enable_caching else None
        if self.host_tier is not None:
            self.pool.taken_listener = self.host_tier.note_taken

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def block_ids(self, request_id: str, group: int = 0) -> BlockTable:
        return [b.block_id if b is not None else None
                for b in self._requests[request_id][group].blocks]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_needed_block(self, group: int, next_position: int) -> int:
        """The first block a token at `next_position` (or later) can still attend to in `group`."""
        window, chunk = self.group_windows[group], self.group_chunks[group]
        if window is not None:
            return max(0, next_position - window + 1) // self.block_size
        if chunk is not None:
            return next_position // chunk * chunk // self.block_size
        return 0

    def _is_full(self, group: int) -> bool:
        return self.group_windows[group] is None and self.group_chunks[group] is None

    # ---- prefix hits -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix every group can serve. At least the last token is left to
        compute (its logits are needed), so a fully cached prompt still recomputes its final
        token."""
        if not self.enable_caching or request.wants_prompt_logprobs:
            return ComputedBlocks()  # (prompt logprobs need every position's logits)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        num_hit = len(hashes)
        for group in range(self.num_groups):
            if self._is_full(group):
                num_hit = min(num_hit, self._num_leading_hits(group, hashes))
        settled = False
        while not settled:  # each window / chunk group may shorten the hit; repeat until all agree
            settled = True
            for group in range(self.num_groups):
                if not self._is_full(group):
                    shorter = self._window_hit(group, hashes, num_hit)
                    settled, num_hit = settled and shorter == num_hit, shorter
        if num_hit == 0:
            return ComputedBlocks()
        tables = []
        for group in range(self.num_groups):
            first = self._first_needed_block(group, num_hit * self.block_size)
            tables.append((None,) * first + tuple(self._hit_block(h, group)
                                                  for h in hashes[first:num_hit]))
        num_host = sum(1 for b in tables[0] if isinstance(b, TierHit))
        return ComputedBlocks(tuple(tables), num_hit * self.block_size, num_host * self.block_size)

    def _holds(self, block_hash: int, group: int) -> bool:
        """The pool or the host tier has this block (a hit continues from one into the other)."""
        return (self.pool.get_cached_block(block_hash, group) is not None
                or (self.host_tier is not None and self.host_tier.contains(block_hash, group)))

    def _hit_block(self, block_hash: int, group: int) -> KVBlock | TierHit:
        block = self.pool.get_cached_block(block_hash, group)
        return block if block is not None else TierHit(group, block_hash)

    def _num_leading_hits(self, group: int, hashes: list[int]) -> int:
        for i, block_hash in enumerate(hashes):
            if not self._holds(block_hash, group):
                return i
        return len(hashes)

    def _window_hit(self, group: int, hashes: list[int], num_hit: int) -> int:
        """The longest hit of at most `num_hit` blocks whose window blocks are all cached in
        `group`."""
        while num_hit > 0:
            first = self._first_needed_block(group, num_hit * self.block_size)
            missing = next((i for i in range(num_hit - 1, first - 1, -1)
                            if not self._holds(hashes[i], group)), None)
            if missing is None:
                return num_hit
            # every longer hit needs block `missing` too (its window starts earlier)
            num_hit = missing
        return 0

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int, num_host_hit_tokens: int = 0
                            ) -> None:
        """Count one admitted request's lookup (not the scheduler's look-aheads) in the hit
        statistics."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens
        self.num_host_hit_tokens += num_host_hit_tokens

    # ---- allocation ------------------------------------------------------------------------------
    def allocate_slots(
            self, request: Request, num_new_tokens: int,
            computed: ComputedBlocks = ComputedBlocks()) -> tuple[BlockTable, ...] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones; take references on
        the cache hits. Returns the request's block table per group, or None if blocks ran out: then
        nothing changed except that window groups may have released blocks no future token can
        see."""
        entry = self._requests.get(request.request_id)
        num_computed = request.num_computed_tokens + computed.num_computed_tokens
        if entry is not None:
            self._release_slid_out(entry, num_computed)
        num_total_tokens = num_computed + num_new_tokens
        hits = computed.blocks or ((),) * self.num_groups
        num_new_blocks = [self.num_blocks_needed(num_total_tokens) - len(hits[g])
                          - (len(entry[g].blocks) if entry else 0) for g in range(self.num_groups)]
        # Cache hits that nobody references sit in the free queue: touching them uses up free
        # blocks; each host tier hit takes a fresh block to be restored into.
        num_evictable_hits = sum(1 for group in hits for b in group
                                 if isinstance(b, KVBlock) and b.ref_cnt == 0)
        num_restores = sum(1 for group in hits for b in group if isinstance(b, TierHit))
        if (sum(max(n, 0) for n in num_new_blocks) + num_restores
                > self.pool.num_free_blocks - num_evictable_hits):
            return None
        if entry is None:
            entry = self._requests[request.request_id] = [
                _GroupBlocks(first_live=self._first_needed_block(g, num_computed))
                for g in range(self.num_groups)]
        # every group's hits first: new blocks never evict them
        for group in range(self.num_groups):
            self.pool.touch(b for b in hits[group] if isinstance(b, KVBlock))
        for group, blocks in enumerate(entry):
            first = len(blocks.blocks)
            blocks.blocks.extend(self._restored(hit, group) if isinstance(hit, TierHit) else hit
                                 for hit in hits[group])
            if num_restores:  # register the restored blocks (BlockStored "main")
                self.pool.cache_full_blocks(blocks.blocks, request.block_hashes,
                                            request.all_token_ids, first, len(blocks.blocks), group)
            blocks.num_cached_blocks += len(hits[group])
            if num_new_blocks[group] > 0:
                blocks.blocks.extend(self.pool.get_new_blocks(num_new_blocks[group]))
        self._cache_full_blocks(request, entry, num_total_tokens)
        return tuple(self.block_ids(request.request_id, g) for g in range(self.num_groups))

    def _restored(self, hit: TierHit, group: int) -> KVBlock:
        """A pool block holding a tier hit's KV by the time the step runs: the pool's own if another
        request cached it since the lookup, else a fresh block the tier restores into."""
        block = self.pool.get_cached_block(hit.block_hash, group)
        if block is not None:
            self.pool.touch((block,))
            return block
        assert self.host_tier is not None
        block = self.pool.get_new_blocks(1)[0]
        self.host_tier.queue_restore(hit.block_hash, group, block.block_id)
        return block

    def take_transfers(self) -> KVTransfers:
        """The copies between the pool and the host tier this step owes (before the model runs)."""
        return self.host_tier.take_transfers() if self.host_tier is not None else KVTransfers()

    def _release_slid_out(self, entry: list[_GroupBlocks], next_position: int) -> None:
        """Window groups: release the blocks wholly before what a token at `next_position` can
        see."""
        for group, blocks in enumerate(entry):
            first = min(self._first_needed_block(group, next_position), len(blocks.blocks))
            released = [b for b in blocks.blocks[blocks.first_live:first] if b is not None]
            if first > blocks.first_live:
                blocks.blocks[blocks.first_live:first] = [None] * (first - blocks.first_live)
                blocks.first_live = first
                self.pool.free_blocks(reversed(released))

    def _cache_full_blocks(self, request: Request, entry: list[_GroupBlocks],
                           num_tokens: int) -> None:
        """Register blocks that will be full once this step's tokens are written (shareable at
        once)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for group, blocks in enumerate(entry):
            if num_full > blocks.num_cached_blocks:
                self.pool.cache_full_blocks(blocks.blocks, request.block_hashes,
                                            request.all_token_ids, blocks.num_cached_blocks,
                                            num_full, group)
                blocks.num_cached_blocks = num_full

    def free(self, request: Request, retain_until_s: float | None = None) -> None:
        """Return the request's blocks, each group's tail first (so the tail is evicted before the
        shared head). With `retain_until_s`, its cached blocks (those findable by hash) first get a
        retention reference under the request's retention key, within the retention bounds."""
        entry = self._requests.pop(request.request_id, None)
        if entry is not None and retain_until_s is not None and self.enable_caching:
            self.retention.retain(request.retention_key, self._retainable(request, entry),
                                  retain_until_s)
        if entry is not None:
            for blocks in entry:
                self.pool.free_blocks(reversed(blocks.blocks))

    def _retainable(self, request: Request, entry: list[_GroupBlocks]) -> list[KVBlock]:
        """The blocks that hold the request's hashes, position-major across groups (the head first);
        a window group only from its window on. A block the request recomputed as a duplicate is
        replaced by the cached block of the same hash."""
        blocks: list[KVBlock] = []
        for i, block_hash in enumerate(request.block_hashes):
            for group, group_blocks in enumerate(entry):
                block = self.pool.get_cached_block(block_hash, group)
                if block is not None and i >= group_blocks.first_live:
                    blocks.append(block)
        return blocks

    def expire_retention(self, now_s: float) -> None:
        self.retention.expire(now_s)

    def release_retention(self) -> None:
        """Drop every retention now (the blocks stay cached, evictable)."""
        self.retention.release_all()

    def release_one_retention(self) -> bool:
        """Drop the retention that expires soonest (its blocks stay cached, evictable); False when
        there is none."""
        return self.retention.release_soonest()

    def reset_prefix_cache(self) -> None:
        self.retention.release_all()
        self.pool.reset_prefix_cache()
        if self.host_tier is not None:
            self.host_tier.clear()
        for entry in self._requests.values():
            for blocks in entry:  # never re-register blocks of running requests
                blocks.num_cached_blocks = len(blocks.blocks)

    def check_integrity(self) -> None:
        """The pool's invariants, every reference held by exactly one live request's table, a block
        in one group at a time, and no window group holding a block before its request's window."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        owner: dict[int, int] = {}
        for entry in self._requests.values():
            for group, blocks in enumerate(entry):
                assert all(b is None for b in blocks.blocks[:blocks.first_live]), (group, blocks)
                assert not self._is_full(group) or blocks.first_live == 0
                for block in blocks.blocks:
                    if block is None:
                        continue
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
                    assert owner.setdefault(block.block_id, group) == group, (block, group)
                    if block.block_hash is not None:
                        assert block.group == group, (block, group)
        self.retention.check_integrity()
        if self.host_tier is not None:
            self.host_tier.check_integrity()
        for block in self.retention.references():
            refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (block,
                                                                  refs.get(block.block_id, 0))

    def num_held_blocks(self, request_id: str, group: int) -> int:
        """Blocks the request references in `group` (window groups: those not yet released)."""
        return sum(1 for b in self._requests[request_id][group].blocks if b is not None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)
