"""HostTier: the second KV tier's bookkeeping. Which (group, block hash) sits in which slot, in LRU
order, within a byte budget, and the copies each step owes. No tensors
(engine/kv_cache/host_storage.py moves the bytes).

A block the pool evicts (its hash dropped so the block can hold new tokens) is copied into a tier
slot before the step that overwrites it runs; a prefix lookup that runs out of pool blocks continues
into the tier, and the blocks it finds there are restored into fresh pool blocks before the step
that reads them. The tier is inclusive: a restored block keeps its slot, so when the pool evicts it
again nothing is copied. Its budget is whole slots: `num_slots = budget_bytes // bytes_per_block`;
when every slot is taken the least recently stored or restored entry gives its slot up.

    pool.get_new_blocks(n)        -> note_taken(block_id, old_key) for each block (evicted: old_key
                                     set)
    manager.get_computed_blocks   -> contains(key): a hit continues into the tier
    manager.allocate_slots        -> queue_restore(key, block_id) for each tier hit, into a fresh
                                     block
    engine.step, before the model -> take_transfers(): slots for this step's evictions (LRU entries
                                     give theirs up, never one a restore of this step reads), then
                                     the copies: offloads (pool -> slot) first, restores (slot ->
                                     pool) after

The same keys as the pool: (group, block hash), the hash chained from the cache salt
(contracts/block_hash.py), so an entry one tenant's request stored is found only by a request with
the same salt and the same whole prefix. KV events (group 0 only, as the pool's): BlockStored "host"
when a block enters the tier, BlockRemoved "host" when it leaves it (its slot given up, or a reset).

A block taken earlier in the same step is never offloaded: its hash was registered for tokens the
step has not written yet (a fresh block, a restore's target), so its bytes are not that hash's KV.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from contracts.kv_events import MEDIUM_HOST, BlockRemoved, BlockStored, KVEventLog

EVENT_GROUP = 0
CacheKey = tuple[int, int]  # (group, block hash), as engine/kv_cache/block_pool.py


@dataclass(frozen=True)
class TierHit:
    """A prefix-hit table entry the host tier serves: restored into a fresh block at allocation."""

    group: int
    block_hash: int


@dataclass(frozen=True)
class KVTransfers:
    """One step's copies: offload pool block offload_block_ids[i] into slot offload_slots[i], then
    restore slot restore_slots[i] into pool block restore_block_ids[i]."""

    offload_block_ids: tuple[int, ...] = ()
    offload_slots: tuple[int, ...] = ()
    restore_slots: tuple[int, ...] = ()
    restore_block_ids: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.offload_slots and not self.restore_slots


class HostTier:
    def __init__(self, num_slots: int, bytes_per_block: int, block_size: int,
                 event_log: KVEventLog | None = None) -> None:
        if num_slots < 1:
            raise ValueError("the host tier needs room for at least one block")
        self.num_slots = num_slots
        self.bytes_per_block = bytes_per_block
        self.block_size = block_size
        self._entries: OrderedDict[CacheKey, int] = OrderedDict()  # key -> slot, least recent first
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        # this step's pool evictions: block id -> its old key
        self._evicted: dict[int, CacheKey] = {}
        self._taken: set[int] = set()  # block ids the pool handed out this step
        self._restores: list[tuple[int, int]] = []  # (slot, block id) this step restores
        self._event_log = event_log
        self.num_offloaded_blocks_total = 0  # blocks copied into the tier
        self.num_restored_blocks_total = 0  # blocks copied back into the pool (tier hits)
        self.num_dropped_blocks_total = 0  # entries that gave their slot up to a newer block, and
        # evicted blocks that found no slot (every slot read or written in their step)

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self.num_slots * self.bytes_per_block

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.bytes_per_block

    def contains(self, block_hash: int, group: int = 0) -> bool:
        return (group, block_hash) in self._entries

    def hashes(self, group: int = EVENT_GROUP) -> list[int]:
        return [h for g, h in self._entries if g == group]

    # ---- the pool's and the manager's calls ------------------------------------------------------
    def note_taken(self, block_id: int, old_key: CacheKey | None) -> None:
        """The pool handed block `block_id` out; `old_key` is the hash it dropped (None: it was
        free)."""
        if old_key is not None and block_id not in self._taken:
            self._evicted[block_id] = old_key
        self._taken.add(block_id)

    def queue_restore(self, block_hash: int, group: int, block_id: int) -> None:
        """Copy the tier's entry for (group, hash) into pool block `block_id` before this step
        runs."""
        key = (group, block_hash)
        slot = self._entries[key]
        self._entries.move_to_end(key)
        self._restores.append((slot, block_id))

    def take_transfers(self) -> KVTransfers:
        """Give this step's evictions their slots and return the copies to make before the model
        runs."""
        pinned = {slot for slot, _ in self._restores}
        new: list[tuple[int, CacheKey]] = []
        for block_id, key in self._evicted.items():  # in eviction order: least recently used first
            if key in self._entries:  # restored earlier and evicted again: the slot still holds it
                self._entries.move_to_end(key)
            else:
                new.append((block_id, key))
        removed: list[int] = []
        assigned: list[tuple[int, CacheKey, int]] = []
        for block_id, key in reversed(new):  # the most recently used get the slots there are
            slot = self._free_slot(pinned, removed)
            if slot is None:
                # every slot is read or written this step: these blocks are recomputed if needed
                break
            pinned.add(slot)
            assigned.append((block_id, key, slot))
        self.num_dropped_blocks_total += len(new) - len(assigned)
        assigned.reverse()
        for _, key, slot in assigned:  # entered oldest first, so the LRU order holds
            self._entries[key] = slot
        offload_ids = [block_id for block_id, _, _ in assigned]
        offload_slots = [slot for _, _, slot in assigned]
        stored = [key[1] for _, key, _ in assigned if key[0] == EVENT_GROUP]
        transfers = KVTransfers(tuple(offload_ids), tuple(offload_slots),
                                tuple(s for s, _ in self._restores),
                                tuple(b for _, b in self._restores))
        self.num_offloaded_blocks_total += len(offload_ids)
        self.num_restored_blocks_total += len(self._restores)
        self._evicted.clear()
        self._taken.clear()
        self._restores = []
        if self._event_log is not None:
            if removed:
                self._event_log.record(BlockRemoved(tuple(removed), MEDIUM_HOST))
            if stored:
                self._event_log.record(BlockStored(tuple(stored), None, (), self.block_size,
                                                   MEDIUM_HOST))
        return transfers

    def _free_slot(self, pinned: set[int], removed: list[int]) -> int | None:
        for i in range(len(self._free_slots) - 1, -1, -1):  # (a reset may free a slot being read)
            if self._free_slots[i] not in pinned:
                return self._free_slots.pop(i)
        for key, slot in self._entries.items():  # least recent first
            if slot not in pinned:
                del self._entries[key]
                self.num_dropped_blocks_total += 1
                if key[0] == EVENT_GROUP:
                    removed.append(key[1])
                return slot
        return None

    def clear(self) -> None:
        """Forget every entry (a prefix-cache reset; the pool's AllBlocksCleared covers both tiers).
        Copies already owed this step still happen; their slots are simply free afterwards."""
        self._free_slots.extend(self._entries.values())
        self._entries.clear()
        self._free_slots.sort(reverse=True)

    def check_integrity(self) -> None:
        """Every slot either free or held by exactly one entry; the bytes within the budget."""
        held = list(self._entries.values())
        assert len(set(held)) == len(held), "two entries share a slot"
        assert not set(held) & set(self._free_slots), "a slot is both free and held"
        assert len(held) + len(self._free_slots) == self.num_slots, (len(held),
                                                                     len(self._free_slots))
        assert all(0 <= s < self.num_slots for s in held + self._free_slots)
        assert self.used_bytes <= self.budget_bytes
