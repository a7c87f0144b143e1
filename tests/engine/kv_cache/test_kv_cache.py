"""BlockPool / KVCacheManager / block_hash on the CPU with fake requests: no model, no tensors.

Every test checks `check_integrity()` after each operation that changes the cache."""

from __future__ import annotations

import random

import orjson
import pytest

from contracts.block_hash import first_block_prefix, hash_block, hash_blocks
from contracts.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventLog,
    apply_events,
)
from engine.kv_cache.manager import ComputedBlocks
from tests.engine.fakes import BLOCK_SIZE, MODEL_ID, admit, make_manager, make_request, tokens


def events_of(log: KVEventLog) -> list:  # type: ignore[type-arg]
    log.seal()
    page = log.since(0)
    assert page is not None
    return [e for batch in page.batches for e in batch.events]


# ---- allocation and freeing ----------------------------------------------------------------------
def test_blocks_are_allocated_on_demand_as_tokens_are_scheduled() -> None:
    manager = make_manager(8)
    request = make_request(tokens(40))
    assert manager.allocate_slots(request, 5) is not None
    manager.check_integrity()
    assert len(manager.block_ids(request.request_id)) == 1
    request.num_computed_tokens = 5
    manager.allocate_slots(request, 11)  # tokens 5..15: still the first block
    request.num_computed_tokens = 16
    assert len(manager.block_ids(request.request_id)) == 1
    manager.allocate_slots(request, 1)  # token 16 opens a second block
    manager.check_integrity()
    assert len(manager.block_ids(request.request_id)) == 2
    assert manager.pool.num_free_blocks == 6


def test_free_returns_every_block_of_a_request() -> None:
    manager = make_manager(8)
    requests = [make_request(tokens(n, start=100 * n)) for n in (3, 17, 40)]
    for request in requests:
        assert admit(manager, request) is not None
        manager.check_integrity()
    assert manager.pool.num_free_blocks == 8 - (1 + 2 + 3)
    for request in requests:
        manager.free(request)
        manager.check_integrity()
    assert manager.pool.num_free_blocks == 8
    assert manager.num_requests == 0
    assert all(block.ref_cnt == 0 for block in manager.pool.blocks)


def test_allocate_slots_returns_none_without_side_effects_when_blocks_run_out() -> None:
    manager = make_manager(4)
    holder = make_request(tokens(33))  # 3 blocks, 2 of them cached
    admit(manager, holder)
    manager.free(holder)
    again = make_request(tokens(33) + tokens(60, start=9000))  # hits 2 cached blocks, needs 4 more
    computed = manager.get_computed_blocks(again)
    assert computed.num_computed_tokens == 32
    before = [(b.ref_cnt, b.block_hash) for b in manager.pool.blocks]
    free_before = manager.pool.num_free_blocks
    assert manager.allocate_slots(again, again.num_tokens - 32, computed) is None
    assert [(b.ref_cnt, b.block_hash) for b in manager.pool.blocks] == before
    assert manager.pool.num_free_blocks == free_before
    assert manager.num_requests == 0
    manager.check_integrity()


def test_cache_hits_that_sit_in_the_free_queue_count_against_free_blocks() -> None:
    manager = make_manager(3)
    holder = make_request(tokens(33))
    admit(manager, holder)  # blocks 0,1 cached, block 2 holds the 33rd token
    manager.free(holder)
    # 2 unreferenced hits + 2 new blocks = 4 > 3 blocks: must refuse, not over-allocate
    request = make_request(tokens(32) + tokens(20, start=5000))
    assert admit(manager, request) is None
    manager.check_integrity()
    assert all(block.ref_cnt == 0 for block in manager.pool.blocks)


# ---- prefix sharing ------------------------------------------------------------------------------
def test_prefix_hits_share_blocks_and_take_references() -> None:
    manager = make_manager(16)
    first = make_request(tokens(40))
    admit(manager, first)
    second = make_request(tokens(32) + tokens(10, start=7000))
    table = admit(manager, second)
    manager.check_integrity()
    assert second.num_cached_tokens == 32
    assert table[:2] == manager.block_ids(first.request_id)[:2]
    assert table[2] != manager.block_ids(first.request_id)[2]
    assert [manager.pool.blocks[i].ref_cnt for i in table] == [2, 2, 1]
    manager.free(first)
    manager.check_integrity()
    assert [manager.pool.blocks[i].ref_cnt for i in table] == [1, 1, 1]


def test_partial_block_is_never_shared() -> None:
    manager = make_manager(16)
    first = make_request(tokens(40))  # 2 full blocks + 8 tokens
    admit(manager, first)
    twin = make_request(tokens(40))
    table = admit(manager, twin)
    manager.check_integrity()
    assert twin.num_cached_tokens == 32
    assert table[2] != manager.block_ids(first.request_id)[2]
    assert manager.pool.blocks[table[2]].block_hash is None


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    manager = make_manager(16)
    admit(manager, make_request(tokens(32)))
    twin = make_request(tokens(32))
    # floor((32 - 1) / 16) blocks
    assert manager.get_computed_blocks(twin).num_computed_tokens == 16


def test_different_cache_salts_share_no_block() -> None:
    manager = make_manager(16)
    tenant_a = make_request(tokens(64), cache_salt="project-a")
    admit(manager, tenant_a)
    tenant_b = make_request(tokens(64), cache_salt="project-b")
    assert manager.get_computed_blocks(tenant_b).num_computed_tokens == 0
    table_b = admit(manager, tenant_b)
    assert not set(table_b) & set(manager.block_ids(tenant_a.request_id))
    assert not set(tenant_a.block_hashes) & set(tenant_b.block_hashes)
    same_tenant = make_request(tokens(64), cache_salt="project-a")
    assert manager.get_computed_blocks(same_tenant).num_computed_tokens == 48
    manager.check_integrity()


def test_disabled_prefix_caching_never_hits() -> None:
    manager = make_manager(16, enable_caching=False)
    admit(manager, make_request(tokens(64)))
    assert manager.get_computed_blocks(make_request(tokens(64))) == ComputedBlocks()
    assert manager.pool.num_cached_blocks == 0


# ---- eviction and events -------------------------------------------------------------------------
def test_lru_eviction_takes_the_tail_of_a_freed_sequence_first() -> None:
    log = KVEventLog("r")
    manager = make_manager(4, event_log=log)
    old = make_request(tokens(48))  # 3 full cached blocks
    admit(manager, old)
    old_hashes = list(old.block_hashes)
    manager.free(old)
    manager.check_integrity()
    # Free queue: the never-used block, then old's blocks tail first. Two new blocks: evicts old's
    # tail.
    newcomer = make_request(tokens(20, start=9000))
    admit(manager, newcomer)
    manager.check_integrity()
    assert set(manager.pool.cached_hashes()) & set(old_hashes) == set(old_hashes[:2])
    removed = [e for e in events_of(log) if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved((old_hashes[2],))]
    # The shared head is still there for a returning request.
    assert manager.get_computed_blocks(make_request(tokens(48))).num_computed_tokens == 32


def test_blocks_freed_earlier_are_evicted_before_blocks_freed_later() -> None:
    manager = make_manager(4)
    first, second = make_request(tokens(16, start=100)), make_request(tokens(16, start=200))
    admit(manager, first)
    admit(manager, second)
    manager.free(first)
    manager.free(second)
    admit(manager, make_request(tokens(40, start=300)))  # 3 blocks: the free one, then first's
    cached = set(manager.pool.cached_hashes())
    assert first.block_hashes[0] not in cached and second.block_hashes[0] in cached
    manager.check_integrity()


def test_reset_emits_all_blocks_cleared_and_forgets_every_hash() -> None:
    log = KVEventLog("r")
    manager = make_manager(8, event_log=log)
    running = make_request(tokens(40))
    admit(manager, running)
    manager.reset_prefix_cache()
    manager.check_integrity()
    assert manager.pool.num_cached_blocks == 0
    assert isinstance(events_of(log)[-1], AllBlocksCleared)
    assert manager.get_computed_blocks(make_request(tokens(40))).num_computed_tokens == 0
    manager.free(running)
    manager.check_integrity()
    assert manager.pool.num_free_blocks == 8


def test_the_event_log_keeps_batches_up_to_its_bytes_and_a_reader_further_behind_resyncs() -> None:
    log = KVEventLog("r", max_bytes=100_000)
    for step in range(40):
        log.record(BlockStored(tuple(range(step * 100, step * 100 + 100)), None, (), 16))
        log.seal()
    assert log.num_bytes <= 100_000 and log.last_seq == 40
    page = log.since(39)
    assert page is not None and [b.seq for b in page.batches] == [40]
    assert log.since(0) is None  # the oldest went by bytes: that reader takes a snapshot
    kept = log.since(page.first_seq - 1)
    assert kept is not None and sum(b.num_bytes for b in kept.batches) == log.num_bytes
    huge = KVEventLog("r", max_bytes=1)
    huge.record(BlockStored((1, 2, 3), None, (), 16))
    huge.seal()
    assert huge.since(0) is not None  # the newest batch stays, whatever its size


def test_stored_event_carries_the_chain_and_no_token_ids() -> None:
    log = KVEventLog("r")
    manager = make_manager(8, event_log=log)
    request = make_request(tokens(40))
    admit(manager, request)
    (stored,) = events_of(log)
    assert stored == BlockStored(tuple(request.block_hashes), None, (), BLOCK_SIZE)
    page = orjson.loads(orjson.dumps(log.since(0).to_json()))  # GET /kv/events, the Redis stream
    assert [e["token_ids"] for b in page["batches"] for e in b["events"]] == [[]]


def test_what_publishers_get_holds_no_token_ids_either() -> None:
    class Recording:  # what the Redis stream publisher is handed (contracts.kv_events)
        def __init__(self) -> None:
            self.batches: list[EventBatch] = []

        def publish(self, batch: EventBatch) -> None:
            self.batches.append(batch)

    publisher = Recording()
    log = KVEventLog("r", publishers=(publisher,))
    manager = make_manager(8, event_log=log)
    admit(manager, make_request(tokens(40)))
    log.seal()
    manager.check_integrity()
    (batch,) = publisher.batches
    (stored,) = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes and stored.token_ids == ()
    assert [list(event["token_ids"]) for event in batch.to_json()["events"]] == [[]]


def test_stored_event_carries_the_tokens_when_the_debug_switch_asks() -> None:
    log = KVEventLog("r", include_token_ids=True)
    manager = make_manager(8, event_log=log)
    request = make_request(tokens(40))
    admit(manager, request)
    (stored,) = events_of(log)
    assert stored == BlockStored(tuple(request.block_hashes), None, tuple(tokens(32)), BLOCK_SIZE)


def test_events_replayed_from_zero_reproduce_the_snapshot_after_a_random_workload() -> None:
    rng = random.Random(7)
    log = KVEventLog("r", capacity=100_000)
    manager = make_manager(24, event_log=log)
    shared = tokens(48, start=50)
    live = []
    for _ in range(300):
        action = rng.random()
        if action < 0.5:
            prompt = (shared[: rng.randrange(0, 49)]
                      + tokens(rng.randrange(1, 60), start=rng.randrange(10**5)))
            request = make_request(prompt, cache_salt=rng.choice([None, "a"]))
            if admit(manager, request) is not None:
                live.append(request)
        elif action < 0.8 and live:
            manager.free(live.pop(rng.randrange(len(live))))
        elif action < 0.82:
            manager.reset_prefix_cache()
        manager.check_integrity()
        log.seal()
    for request in live:
        manager.free(request)
    manager.check_integrity()
    log.seal()
    held: set[int] = set()
    page = log.since(0)
    assert page is not None and [b.seq for b in page.batches] == list(range(1, log.last_seq + 1))
    for batch in page.batches:
        apply_events(held, batch.events)
    assert held == set(log.snapshot(BLOCK_SIZE).block_hashes) == set(manager.pool.cached_hashes())
    assert all(block.ref_cnt == 0 for block in manager.pool.blocks)
    assert manager.pool.num_free_blocks == manager.num_blocks


# ---- block_hash ----------------------------------------------------------------------------------
def test_block_hashes_are_deterministic_and_only_cover_full_blocks() -> None:
    ids = tokens(50)
    assert hash_blocks(ids, 16, MODEL_ID) == hash_blocks(list(ids), 16, MODEL_ID)
    assert len(hash_blocks(ids, 16, MODEL_ID)) == 3
    assert hash_blocks(tokens(15), 16, MODEL_ID) == []
    assert all(0 <= h < 2**64 for h in hash_blocks(ids, 16, MODEL_ID))


def test_block_hash_is_pinned_to_its_documented_encoding() -> None:
    """A gateway in another process must compute the same numbers: pin the wire format."""
    import struct

    import xxhash

    first = xxhash.xxh3_64_intdigest(b"aigw-kv-v1\x1em\x1fs\x1f" + struct.pack("<16I", *range(16)))
    second = xxhash.xxh3_64_intdigest(struct.pack("<Q", first)
                                      + struct.pack("<16I", *range(16, 32)))
    assert hash_blocks(list(range(32)), 16, "m", "s") == [first, second]


def test_changing_an_early_token_changes_every_later_hash() -> None:
    ids = tokens(64)
    changed = list(ids)
    changed[3] += 1
    a, b = hash_blocks(ids, 16, MODEL_ID), hash_blocks(changed, 16, MODEL_ID)
    assert all(x != y for x, y in zip(a, b, strict=True))
    late = list(ids)
    late[40] += 1
    c = hash_blocks(late, 16, MODEL_ID)
    assert c[:2] == a[:2] and c[2:] != a[2:]


def test_salt_and_model_id_enter_only_through_the_first_block() -> None:
    ids = tokens(48)
    plain = hash_blocks(ids, 16, MODEL_ID)
    for salted in (hash_blocks(ids, 16, MODEL_ID, "tenant"), hash_blocks(ids, 16, "other-model")):
        assert all(x != y for x, y in zip(plain, salted, strict=True))
        # Later blocks depend on the salt only through their parent hash.
        assert salted[1] == hash_block(salted[0], ids[16:32])
    assert plain[0] == hash_block(first_block_prefix(MODEL_ID, None), ids[:16])
    assert hash_blocks(ids, 16, MODEL_ID, None) == hash_blocks(ids, 16, MODEL_ID, "")


@pytest.mark.parametrize("split", [0, 15, 16, 17, 40, 64])
def test_incremental_hashing_equals_hashing_all_at_once(split: int) -> None:
    ids = tokens(70)
    known = hash_blocks(ids[:split], 16, MODEL_ID, "s")
    assert (hash_blocks(ids, 16, MODEL_ID, "s", parent_hashes=known)
            == hash_blocks(ids, 16, MODEL_ID, "s"))


def test_request_block_hashes_grow_with_its_output() -> None:
    request = make_request(tokens(30))
    assert len(request.block_hashes) == 1
    request.output_token_ids.extend(tokens(3, start=1))
    request.update_block_hashes(BLOCK_SIZE, MODEL_ID)
    assert request.block_hashes == hash_blocks(request.all_token_ids, BLOCK_SIZE, MODEL_ID)
    assert len(request.block_hashes) == 2
