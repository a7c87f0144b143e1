"""The second KV tier (engine/kv_cache/host_tier.py, host_storage.py): blocks the pool evicts are
copied out before the step that overwrites them, and a prefix hit that runs out of pool blocks
continues into the tier and is restored into fresh blocks before the step that reads them.

Bookkeeping runs on the fake manager with real KV-shaped tensors and the real mapped-file storage;
the round trip runs on the real default model (SmolLM2-135M): the restored KV equals the evicted KV
bit for bit, and greedy tokens after a tier hit equal a recompute."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from contracts.kv_events import (
    MEDIUM_HOST,
    MEDIUM_MAIN,
    BlockRemoved,
    BlockStored,
    KVEventLog,
    apply_events,
    batch_from_json,
)
from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.kv_cache.host_storage import HostTierStorage
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.manager import KVCacheManager
from tests.engine.fakes import BLOCK_SIZE, admit, assert_idle_and_clean, drive, make_request, tokens


class Tiered:
    """A manager with a host tier of `num_slots` and KV tensors [num_blocks, 16, 2, 4] (K and V of
    two layers), random, so every block's bytes are distinct and copies can be checked."""

    def __init__(self, num_blocks: int, num_slots: int, events: bool = False,
                 group_windows: tuple[int | None, ...] = (None,)) -> None:
        self.log = KVEventLog("r") if events else None
        gen = torch.Generator().manual_seed(num_blocks * 31 + num_slots)
        self.kv = [torch.randn(num_blocks, BLOCK_SIZE, 2, 4, generator=gen) for _ in range(4)]
        self.storage = HostTierStorage(self.kv, num_slots)
        self.tier = HostTier(num_slots, self.storage.bytes_per_block, BLOCK_SIZE, self.log)
        self.manager = KVCacheManager(num_blocks, BLOCK_SIZE, True, self.log, group_windows,
                                      host_tier=self.tier)

    def step(self) -> None:
        """What LLMEngine.step does around the model: the tier's copies, then the step's writes
        (each block a request now holds gets fresh random bytes, as computed KV would)."""
        self.storage.apply(self.manager.take_transfers())
        if self.log is not None:
            self.log.seal()

    def block_bytes(self, block_id: int) -> torch.Tensor:
        return torch.stack([t[block_id] for t in self.kv])

    def run(self, prompt: list[int], salt: str | None = None, abort: bool = False) -> Any:
        """Admit a request for its whole prompt, do the step's copies, write its new blocks, free
        it."""
        request = make_request(prompt, cache_salt=salt)
        table = admit(self.manager, request)
        assert table is not None
        restored = set(self.storage_restore_targets())
        self.step()
        for block_id in table[request.num_cached_tokens // BLOCK_SIZE:]:  # computed this step
            if block_id not in restored:
                for t in self.kv:
                    t[block_id].normal_()
        self.manager.free(request)
        self.manager.check_integrity()
        return request, table

    def storage_restore_targets(self) -> list[int]:
        return [block_id for _, block_id in self.tier._restores]


def test_evicted_blocks_move_to_the_tier_and_come_back_bit_exact() -> None:
    t = Tiered(num_blocks=8, num_slots=16)
    # 5 full blocks, 4 of them a later hit can use (the last token is recomputed)
    prompt_a = tokens(80)
    request, table = t.run(prompt_a)
    kept = {h: t.block_bytes(b).clone() for h, b in zip(request.block_hashes, table, strict=False)}
    other, other_table = t.run(tokens(120, start=5000))  # 8 blocks: evicts every block of A
    assert t.manager.pool.num_cached_blocks == 7 and t.tier.num_blocks == 5
    kept_other = {h: t.block_bytes(b).clone() for h, b in zip(other.block_hashes, other_table,
                                                                strict=False)}
    again, table2 = t.run(prompt_a)  # its restores take B's blocks: B's go out before A's come in
    assert again.num_cached_tokens == 64  # 4 blocks, all restored from the tier
    offloaded = [h for h in other.block_hashes if t.tier.contains(h)]
    assert len(offloaded) >= 4
    for block_hash in offloaded:
        slot = t.tier._entries[(0, block_hash)]
        assert torch.equal(t.storage.read_slot(slot), kept_other[block_hash])
    for block_hash, block_id in zip(again.block_hashes[:4], table2[:4], strict=True):
        assert torch.equal(t.block_bytes(block_id), kept[block_hash])
    assert t.tier.num_restored_blocks_total == 4


def test_a_hit_continues_from_the_pool_into_the_tier() -> None:
    t = Tiered(num_blocks=8, num_slots=16)
    prompt_a = tokens(80)
    t.run(prompt_a)  # 5 blocks; freed tail first, so its tail is evicted first
    t.run(tokens(40, start=5000))  # 3 blocks from the never-used ones, then A's tail
    t.run(tokens(40, start=7000))
    pool_hits = sum(1 for h in make_request(prompt_a).block_hashes[:4]
                    if t.manager.pool.get_cached_block(h) is not None)
    assert 0 < pool_hits < 4
    computed = t.manager.get_computed_blocks(make_request(prompt_a))
    assert computed.num_computed_tokens == 64
    assert computed.num_host_tokens == (4 - pool_hits) * BLOCK_SIZE


def test_budget_is_whole_blocks_and_the_oldest_entry_gives_its_slot_up() -> None:
    t = Tiered(num_blocks=6, num_slots=3, events=True)
    assert t.tier.budget_bytes == 3 * t.storage.bytes_per_block
    held: set[int] = set()
    host_held: set[int] = set()
    for start in range(0, 20_000, 4000):
        t.run(tokens(80, start=start))
        assert t.tier.used_bytes <= t.tier.budget_bytes
        t.tier.check_integrity()
    assert t.tier.num_blocks == 3
    assert t.tier.num_dropped_blocks_total > 0
    assert t.log is not None
    page = t.log.since(0)
    assert page is not None
    for batch in page.batches:  # replayed through JSON, as the gateway reads them
        apply_events(held, batch_from_json(batch.to_json()).events, host_held)
    assert host_held == set(t.tier.hashes())
    assert held == set(t.manager.pool.cached_hashes())
    snapshot = t.log.snapshot(BLOCK_SIZE)
    assert set(snapshot.host_block_hashes) == host_held and set(snapshot.block_hashes) == held


def test_events_say_when_a_block_moves_to_and_leaves_the_tier() -> None:
    t = Tiered(num_blocks=6, num_slots=16, events=True)
    assert t.log is not None
    request, _ = t.run(tokens(48))  # 3 full blocks
    t.run(tokens(90, start=9000))  # 6 blocks: evicts A's three
    moved = t.log.since(t.log.last_seq - 1)
    assert moved is not None
    events = moved.batches[-1].events
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_MAIN]
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_HOST]
    evicted = {h for e in removed for h in e.block_hashes}
    assert set(request.block_hashes) <= evicted
    assert set(request.block_hashes) <= {h for e in stored for h in e.block_hashes}
    seq = t.log.last_seq
    t.run(tokens(48))  # restored: stored in the main pool again, still in the tier
    page = t.log.since(seq)
    assert page is not None
    restored = {h for b in page.batches for e in b.events
                if isinstance(e, BlockStored) and e.medium == MEDIUM_MAIN for h in e.block_hashes}
    assert set(request.block_hashes[:2]) <= restored
    assert all(t.tier.contains(h) for h in request.block_hashes)
    t.manager.reset_prefix_cache()
    assert t.tier.num_blocks == 0


def test_nothing_one_salt_stored_is_found_with_another() -> None:
    t = Tiered(num_blocks=6, num_slots=16)
    prompt = tokens(64)
    t.run(prompt, salt="tenant-a")
    t.run(tokens(90, start=9000), salt="tenant-a")  # evicts tenant-a's prompt into the tier
    assert t.tier.num_blocks >= 3
    for salt in ("tenant-b", None):
        assert t.manager.get_computed_blocks(make_request(prompt,
                                                          cache_salt=salt)).num_computed_tokens == 0
    hit = t.manager.get_computed_blocks(make_request(prompt, cache_salt="tenant-a"))
    assert hit.num_host_tokens == hit.num_computed_tokens == 48


def test_an_abort_before_the_restore_runs_leaks_nothing_and_the_block_still_gets_its_bytes(
        ) -> None:
    t = Tiered(num_blocks=6, num_slots=16)
    prompt = tokens(64)
    first, table = t.run(prompt)
    kept = {h: t.block_bytes(b).clone()
            for h, b in zip(first.block_hashes[:3], table, strict=False)}
    t.run(tokens(90, start=9000))
    request = make_request(prompt)
    assert admit(t.manager, request) is not None  # restores queued into fresh blocks
    targets = t.storage_restore_targets()
    assert len(targets) == 3
    t.manager.free(request)  # aborted before the step ran
    t.manager.check_integrity()
    t.step()  # the copies owed still happen: the blocks' hashes are registered
    assert t.manager.pool.num_free_blocks == t.manager.num_blocks
    for block_hash in first.block_hashes[:3]:
        block = t.manager.pool.get_cached_block(block_hash)
        assert block is not None and torch.equal(t.block_bytes(block.block_id), kept[block_hash])
    t.manager.check_integrity()


def test_a_slot_being_restored_is_never_given_to_this_steps_eviction() -> None:
    t = Tiered(num_blocks=4, num_slots=2)
    prompt = tokens(48)  # 3 blocks; a hit uses 2
    first, table = t.run(prompt)
    kept = {h: t.block_bytes(b).clone()
            for h, b in zip(first.block_hashes[:2], table, strict=False)}
    t.run(tokens(60, start=9000))  # 4 blocks: A's 3 evicted into 2 slots (its tail dropped again)
    assert t.tier.num_blocks == 2 and all(t.tier.contains(h) for h in kept)
    request, table = t.run(prompt)  # its restores evict blocks while both slots are being read
    assert request.num_cached_tokens == 32
    for block_hash, block_id in zip(first.block_hashes[:2], table, strict=False):
        assert torch.equal(t.block_bytes(block_id), kept[block_hash])
    assert all(t.tier.contains(h) for h in kept)


def test_a_sliding_window_group_restores_only_the_blocks_its_window_needs() -> None:
    from tests.engine.fakes import admit_groups

    t = Tiered(num_blocks=24, num_slots=64, group_windows=(None, 32))
    prompt = tokens(96)  # 6 blocks per full group; the window group keeps the last ~3
    request = make_request(prompt)
    assert admit_groups(t.manager, request) is not None
    t.step()
    t.manager.free(request)
    t.run(tokens(150, start=9000))  # evicts everything of the first prompt into the tier
    t.run(tokens(150, start=19000))
    again = make_request(prompt)
    computed = t.manager.get_computed_blocks(again)
    assert computed.num_computed_tokens == 80 and computed.num_host_tokens == 80
    window_table = computed.blocks[1]
    assert window_table[:3] == (None, None, None)  # positions 48-79 are all the window needs
    assert admit_groups(t.manager, again) is not None
    restores = len(t.storage_restore_targets())
    assert restores == 5 + 2
    t.step()
    t.manager.free(again)
    t.manager.check_integrity()
    assert t.manager.pool.num_free_blocks == t.manager.num_blocks


# ---- the real default model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tier_engines(model_path: str, checkpoint: Any, tokenizer: Any) -> tuple[LLMEngine, LLMEngine]:
    """Two engines over the shared weights with a 16-block pool: one with a host tier of 32 blocks,
    one without (the recompute)."""
    from engine.kv_cache.layout import kv_bytes_per_token
    from engine.model_runner import ModelRunner

    model = checkpoint.config
    # float32, full attention
    bytes_per_block = 16 * model.num_layers * kv_bytes_per_token(model, 4)

    def make(host_tier_blocks: int) -> LLMEngine:
        config = EngineConfig(
            model_path=model_path, num_threads=1, dtype="float32",
            cache=CacheConfig(kv_cache_memory_bytes=16 * bytes_per_block,
                              host_tier_bytes=host_tier_blocks * bytes_per_block),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))
        runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights),
                             dict(checkpoint.raw))
        assert runner.num_blocks == 16
        return LLMEngine(config, checkpoint.config, runner, tokenizer)

    return make(32), make(0)


def _kv_of(engine: LLMEngine, block_id: int) -> torch.Tensor:
    assert engine.host_storage is not None
    return torch.stack([t[block_id] for t in engine.host_storage.kv_tensors]).clone()


def test_real_model_tier_hit_restores_the_evicted_kv_and_the_same_tokens(
        tier_engines: tuple[LLMEngine, LLMEngine], tokenizer: Any) -> None:
    engine, recompute = tier_engines
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    text = ("The gateway routes each request to the replica that holds its prefix; the replica "
            "keeps the prompt's KV blocks so that the next turn of the conversation reuses them.")
    prompt = tokenizer.backend.encode(text * 3).ids[:96]  # 6 full blocks; a later hit can use 5
    engine.add_request("a", prompt, greedy)
    first = drive(engine)["a"]
    probe = make_request(prompt, hashed=False)
    probe.update_block_hashes(16, engine.model_config.model_id)
    kept = {}
    for block_hash in probe.block_hashes[:5]:
        block = engine.kv_cache.pool.get_cached_block(block_hash)
        assert block is not None
        kept[block_hash] = _kv_of(engine, block.block_id)
    for i in range(2):  # 2 x 10 blocks of other prompts: A's blocks leave the 16-block pool
        engine.add_request(f"filler-{i}", tokens(150, start=1000 + 3000 * i),
                           SamplingParams(max_tokens=1))
        drive(engine)
    assert all(engine.kv_cache.pool.get_cached_block(h) is None for h in probe.block_hashes[:5])
    assert all(engine.kv_cache.host_tier is not None and engine.kv_cache.host_tier.contains(h)
               for h in probe.block_hashes[:5])
    before = engine.stats()
    engine.add_request("a-again", prompt, greedy)
    again = drive(engine)["a-again"]
    after = engine.stats()
    assert again.num_cached_tokens == 80  # counts as cached tokens
    assert again.timings["num_host_cached_tokens"] == 80  # per request: all 80 from the tier
    assert after.num_host_tier_hit_tokens - before.num_host_tier_hit_tokens == 80
    assert after.num_prompt_tokens_computed_total - before.num_prompt_tokens_computed_total == 16
    assert again.token_ids == first.token_ids  # greedy after a tier hit == the first computation
    for block_hash, kv in kept.items():
        block = engine.kv_cache.pool.get_cached_block(block_hash)
        assert block is not None and torch.equal(_kv_of(engine, block.block_id), kv)
    recompute.add_request("r", prompt, greedy)
    assert drive(recompute)["r"].token_ids == first.token_ids
    assert after.num_host_tier_bytes <= after.host_tier_budget_bytes
    assert_idle_and_clean(engine)
    from engine.server.metrics import ReplicaMetrics

    scrape = ReplicaMetrics(engine.stats, model="m", replica="r").render().decode()
    series = {x.split("{")[0]: float(x.rsplit(" ", 1)[1]) for x in scrape.splitlines()
              if x.startswith("aigw_replica_kv_host_tier")}
    assert series["aigw_replica_kv_host_tier_hit_tokens_total"] == after.num_host_tier_hit_tokens
    assert series["aigw_replica_kv_host_tier_budget_bytes"] == after.host_tier_budget_bytes
    assert series["aigw_replica_kv_host_tier_restored_blocks_total"] >= 5


def test_the_replica_flags_make_the_engine_config() -> None:
    import argparse

    from engine.engine_args import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["--kv-host-tier-bytes", "1048576",
                                                        "--kv-host-tier-dir", "/var/tmp"]))
    assert (config.cache.host_tier_bytes, config.cache.host_tier_dir) == (1 << 20, "/var/tmp")
    assert engine_config_from_args(parser.parse_args([])).cache.host_tier_bytes == 0
    with pytest.raises(ValueError, match="host_tier_bytes"):
        CacheConfig(host_tier_bytes=-1)
    with pytest.raises(ValueError, match="at least one"):
        HostTierStorage.for_kv([torch.zeros(4, 16, 2, 4)], budget_bytes=100)


def test_real_model_abort_after_a_restore_leaks_nothing(
        tier_engines: tuple[LLMEngine, LLMEngine]) -> None:
    engine, _ = tier_engines
    prompt = tokens(200, start=20_000)  # 4 steps of 64 tokens
    engine.add_request("long", prompt, SamplingParams(max_tokens=1))
    drive(engine)
    for i in range(2):
        engine.add_request(f"evict-{i}", tokens(120, start=40_000 + 500 * i),
                           SamplingParams(max_tokens=1))
        drive(engine)
    engine.add_request("long-again", prompt, SamplingParams(max_tokens=4))
    engine.step()  # admitted: its tier hits restored, the first chunk after them computed
    assert engine.stats().num_host_tier_restored_blocks_total > 0
    engine.abort_request("long-again")
    assert_idle_and_clean(engine)
