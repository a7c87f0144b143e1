"""KV cache groups with sliding windows, on the CPU with fake requests (no model, no tensors):
window groups release what no future token can see, hits need the window's blocks, nothing leaks.

Every test checks `check_integrity()` after each operation that changes the cache."""

from __future__ import annotations

from dataclasses import replace

import pytest

from contracts.kv_events import KVEventLog, apply_events
from engine.config import ModelConfig, SchedulerConfig
from engine.kv_cache.layout import KVCacheLayout, kv_bytes_per_sequence
from engine.outputs import FinishReason
from engine.scheduler import Scheduler
from tests.engine.fakes import (
    BLOCK_SIZE,
    admit_groups,
    make_manager,
    make_request,
    run_to_completion,
    simulate_step,
    tokens,
)

WINDOW = 40  # tokens: a query at p sees p-39..p, i.e. 3 or 4 blocks of 16
FULL_AND_WINDOW = (None, WINDOW)


def decode_steps(manager, request, num_steps):  # type: ignore[no-untyped-def]
    """Grow `request` one token a step, as the scheduler would; check the cache after each step."""
    for _ in range(num_steps):
        request.output_token_ids.append(7)
        request.update_block_hashes(BLOCK_SIZE, "fake-model")
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.check_integrity()


def test_window_group_memory_stays_bounded_while_the_full_group_grows() -> None:
    manager = make_manager(64, group_windows=FULL_AND_WINDOW)
    request = make_request(tokens(100), max_tokens=200)
    admit_groups(manager, request)
    manager.check_integrity()
    held = []
    for _ in range(10):
        decode_steps(manager, request, 20)
        held.append(manager.num_held_blocks(request.request_id, 1))
    assert manager.num_held_blocks(request.request_id, 0) == -(-request.num_tokens // BLOCK_SIZE)
    assert max(held) <= -(-(WINDOW - 1) // BLOCK_SIZE) + 1  # the next token's window, in blocks
    table = manager.block_ids(request.request_id, 1)
    first_live = next(i for i, b in enumerate(table) if b is not None)
    assert all(b is None for b in table[:first_live])
    assert (first_live + 1) * BLOCK_SIZE > request.num_computed_tokens - WINDOW + 1  # still seen


def test_released_window_blocks_go_back_to_the_pool_as_the_window_moves() -> None:
    manager = make_manager(32, enable_caching=False, group_windows=FULL_AND_WINDOW)
    request = make_request(tokens(64), max_tokens=64)
    admit_groups(manager, request)  # prefill of 64: both groups hold 4 blocks
    assert manager.num_free_blocks == 32 - 8
    decode_steps(manager, request, 1)  # next position 65 sees 26..64: block 0 (0..15) released
    assert manager.block_ids(request.request_id, 1)[0] is None
    assert manager.num_free_blocks == 32 - 4 - 1 - 4  # full: 5 blocks; window: blocks 1..4
    manager.free(request)
    manager.check_integrity()
    assert manager.num_free_blocks == 32


def test_a_long_prefill_chunk_holds_its_blocks_until_the_next_step() -> None:
    manager = make_manager(32, enable_caching=False, group_windows=FULL_AND_WINDOW)
    request = make_request(tokens(160))
    admit_groups(manager, request, 80)  # chunk 1: positions 0..79, all written this step
    assert manager.num_held_blocks(request.request_id, 1) == 5
    assert manager.allocate_slots(request, 80) is not None  # chunk 2 starts at 80: sees 41..
    request.num_computed_tokens = 160
    manager.check_integrity()
    assert manager.block_ids(request.request_id, 1)[:2] == [None, None]  # blocks 0, 1 released
    assert manager.num_held_blocks(request.request_id, 1) == 10 - 2


def test_prefix_hit_takes_full_blocks_and_only_the_window_blocks() -> None:
    manager = make_manager(64, group_windows=FULL_AND_WINDOW)
    first = make_request(tokens(100))
    admit_groups(manager, first)
    manager.free(first)
    manager.check_integrity()
    twin = make_request(tokens(96) + tokens(10, start=9000))
    computed = manager.get_computed_blocks(twin)
    assert computed.num_computed_tokens == 96
    full, window = computed.blocks
    assert len(full) == 6 and all(b is not None for b in full)
    # the first computed token (position 96) sees 57..96: blocks 3, 4, 5; blocks 0..2 are not needed
    assert window[:3] == (None, None, None) and all(b is not None for b in window[3:])
    tables = admit_groups(manager, twin)
    assert tables is not None
    manager.check_integrity()
    assert tables[1][:3] == [None, None, None]
    assert twin.num_cached_tokens == 96


def test_prefix_hit_shrinks_to_where_the_window_blocks_are_still_cached() -> None:
    manager = make_manager(48, group_windows=FULL_AND_WINDOW)
    first = make_request(tokens(100), max_tokens=100)
    admit_groups(manager, first)
    decode_steps(manager, first, 60)  # the window moved on: group 1's blocks 0..6 released, cached
    short = make_request(tokens(50) + tokens(20, start=8000))  # hits 3 blocks, holds group 1's 0..2
    admit_groups(manager, short)
    taken = manager.pool.get_new_blocks(manager.num_free_blocks)  # evict every unreferenced block
    manager.pool.free_blocks(taken)
    manager.check_integrity()
    hashes = first.block_hashes
    cached = {i for i in range(7) if manager.pool.get_cached_block(hashes[i], group=1) is not None}
    assert cached == {0, 1, 2}

    twin = make_request(tokens(100))  # 6 full blocks are hits in group 0 (first still holds them)
    computed = manager.get_computed_blocks(twin)

    def window_blocks(k: int) -> range:  # what a hit of k blocks needs cached in group 1
        return range(max(0, k * BLOCK_SIZE - WINDOW + 1) // BLOCK_SIZE, k)

    expected = max(k for k in range(7) if set(window_blocks(k)) <= cached)
    assert expected == 3 and computed.num_computed_tokens == expected * BLOCK_SIZE
    assert admit_groups(manager, twin) is not None
    manager.check_integrity()


def test_window_group_stores_and_evictions_emit_no_kv_events() -> None:
    log = KVEventLog("replica-0")
    manager = make_manager(12, group_windows=FULL_AND_WINDOW, event_log=log)
    for start in (0, 5000, 9000):  # the third request evicts what the first two cached
        request = make_request(tokens(50, start=start))
        admit_groups(manager, request)
        manager.free(request)
        manager.check_integrity()
    log.seal()
    held: set[int] = set()
    page = log.since(0)
    assert page is not None
    for batch in page.batches:
        apply_events(held, batch.events)
    assert held == set(manager.pool.cached_hashes(0)) == set(log.snapshot(BLOCK_SIZE).block_hashes)
    assert set(manager.pool.cached_hashes(1)) - held  # group 1 caches blocks the events never name


@pytest.mark.parametrize("num_blocks", [14, 40])
def test_scheduler_with_windows_preempts_and_finishes_without_leaking(num_blocks: int) -> None:
    manager = make_manager(num_blocks, group_windows=FULL_AND_WINDOW)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8), manager)
    prompts = [tokens(70), tokens(64) + tokens(30, start=4000), tokens(90, start=7000), tokens(20)]
    requests = [make_request(p, max_tokens=30) for p in prompts]
    for request in requests:
        scheduler.add_request(request)
    run_to_completion(scheduler)  # checks integrity after every step
    assert all(r.num_output_tokens == 30 for r in requests)
    if num_blocks == 14:
        assert scheduler.num_preemptions_total > 0
    assert manager.num_requests == 0 and manager.num_free_blocks == num_blocks


def test_abort_mid_decode_returns_every_block_of_every_group() -> None:
    manager = make_manager(40, group_windows=FULL_AND_WINDOW)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), manager)
    request = make_request(tokens(80), max_tokens=100)
    scheduler.add_request(request)
    for _ in range(30):
        simulate_step(scheduler, scheduler.schedule())
        manager.check_integrity()
    assert manager.block_ids(request.request_id, 1)[0] is None  # the window has moved on
    scheduler.finish(request, FinishReason.ABORT)
    manager.check_integrity()
    assert manager.num_free_blocks == 40


GPT_OSS_20B = ModelConfig(architecture="gpt_oss", vocab_size=201088, hidden_size=2880,
                          intermediate_size=2880, num_layers=24, num_heads=64, num_kv_heads=8,
                          head_dim=64, max_position_embeddings=131072,
                          layer_types=("sliding_attention", "full_attention") * 12,
                          sliding_window=128, num_experts=32, num_experts_per_tok=4)


def test_layout_pairs_window_and_full_layers_on_shared_tensor_slots() -> None:
    layout = KVCacheLayout.for_model(GPT_OSS_20B, max_model_len=131072)
    assert layout.group_windows == (None, 128) and layout.num_tensor_slots == 12
    assert layout.layer_group[:4] == (1, 0, 1, 0) and layout.layer_slot[:4] == (0, 0, 1, 1)
    # a window as long as the context never binds: one full group of every layer
    short = KVCacheLayout.for_model(GPT_OSS_20B, max_model_len=128)
    assert short.group_windows == (None,) and short.num_tensor_slots == 24


@pytest.mark.parametrize(("num_layers", "full_mib", "windowed_mib"),
                         # gpt-oss-20b, -120b (docs/models.md)
                         [(24, 1536, 771), (36, 2304, 1156.5)])
def test_a_32k_sequence_needs_about_half_the_kv_bytes_of_full_attention(
        num_layers: int, full_mib: float, windowed_mib: float) -> None:
    config = replace(GPT_OSS_20B, num_layers=num_layers,
                     layer_types=("sliding_attention", "full_attention") * (num_layers // 2))
    layout = KVCacheLayout.for_model(config, max_model_len=131072)
    hybrid = kv_bytes_per_sequence(layout, config, 32768, 16, element_size=2)
    dense = kv_bytes_per_sequence(KVCacheLayout.full_attention(num_layers), config, 32768, 16,
                                  element_size=2)
    assert dense == num_layers * 32768 * 2 * 8 * 64 * 2 == full_mib * 2**20
    half = num_layers // 2  # full layers: every token; window layers: the window's 8 blocks
    assert hybrid == half * (32768 + 8 * 16) * 2 * 8 * 64 * 2 == windowed_mib * 2**20
