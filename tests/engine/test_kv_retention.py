"""Retention: a finished request's cached prompt blocks kept safe from LRU eviction for its retention
time, bounded per owner (cache salt) and in all, superseded by the same session's next retention,
never kept for an abort, never stalling an idle engine; check_integrity counts retention references."""

from __future__ import annotations

import time

import pytest

from engine.config import SchedulerConfig
from engine.outputs import FinishReason
from engine.request import Request
from engine.scheduler import Scheduler
from tests.engine.fakes import BLOCK_SIZE, make_manager, make_request, run_to_completion, tokens


def retained(prompt: list[int], retain_s: float, salt: str | None = None,
             session: str | None = None) -> Request:
    request = make_request(prompt, max_tokens=1, cache_salt=salt)
    request.retain_s, request.retention_id = retain_s, session
    return request


def scheduler_of(num_blocks: int, **shares: float) -> Scheduler:
    manager = make_manager(num_blocks)
    if shares:  # rebuild with other bounds
        from engine.kv_cache.manager import KVCacheManager
        manager = KVCacheManager(num_blocks, BLOCK_SIZE, True, None, (None,), **shares)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16), manager)


def run(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)
    run_to_completion(scheduler)


def num_cached_blocks_of(scheduler: Scheduler, prompt: list[int]) -> int:
    probe = make_request(prompt + [1])
    return scheduler.kv_cache.get_computed_blocks(probe).num_computed_tokens // BLOCK_SIZE


def test_a_retained_prefix_survives_pressure_that_evicts_an_unretained_one() -> None:
    kept, plain = tokens(160, start=1000), tokens(160, start=20_000)
    for retain_s, expected in ((600.0, 10), (0.0, 0)):
        scheduler = scheduler_of(60, retention_share_per_owner=0.5)
        run(scheduler, retained(kept, retain_s), make_request(plain, max_tokens=1))  # 10 blocks each
        run(scheduler, make_request(tokens(800, start=50_000), max_tokens=1))  # 50 blocks: evicts LRU
        assert num_cached_blocks_of(scheduler, kept) == expected  # (kept was freed first: LRU)
        assert num_cached_blocks_of(scheduler, plain) == (0 if retain_s else 10)
        scheduler.kv_cache.check_integrity()


def test_retention_expires_and_its_blocks_become_evictable() -> None:
    scheduler = scheduler_of(64)
    prompt = tokens(96)
    run(scheduler, retained(prompt, 0.05))
    manager = scheduler.kv_cache
    assert manager.retention.num_blocks == 6 and manager.num_free_blocks == 64 - 6
    time.sleep(0.06)
    scheduler.schedule()  # a step expires what is due
    assert manager.retention.num_blocks == 0 and manager.num_free_blocks == 64
    assert num_cached_blocks_of(scheduler, prompt) == 6  # still cached, just no longer protected
    manager.check_integrity()


def test_one_owner_keeps_at_most_its_share_and_others_still_get_theirs() -> None:
    scheduler = scheduler_of(100)  # 25 blocks per owner, 50 in all
    run(scheduler, retained(tokens(320, start=1000), 600, salt="a", session="s1"),
        retained(tokens(320, start=9000), 600, salt="a", session="s2"))
    manager = scheduler.kv_cache
    assert manager.retention.num_blocks_of("a") == 25  # 20 + 5: the second keeps its head only
    run(scheduler, retained(tokens(320, start=30_000), 600, salt="b"),
        retained(tokens(320, start=40_000), 600, salt="c"))
    assert manager.retention.num_blocks_of("b") == 20 and manager.retention.num_blocks_of("c") == 5
    assert manager.retention.num_blocks == 50
    manager.check_integrity()


def test_the_same_session_retaining_again_releases_its_previous_prefix() -> None:
    scheduler = scheduler_of(100)
    run(scheduler, retained(tokens(160, start=1000), 600, session="agent-1"))
    run(scheduler, retained(tokens(160, start=7000), 600, session="agent-1"))
    assert scheduler.kv_cache.retention.num_blocks == 10
    run(scheduler, retained(tokens(160, start=1000), 600, session="agent-2"))
    assert scheduler.kv_cache.retention.num_blocks == 20
    scheduler.kv_cache.check_integrity()


def test_an_aborted_request_keeps_nothing() -> None:
    scheduler = scheduler_of(64)
    request = retained(tokens(100), 600)
    scheduler.add_request(request)
    scheduler.schedule()
    scheduler.finish(request, FinishReason.ABORT)
    assert scheduler.kv_cache.retention.num_blocks == 0
    assert scheduler.kv_cache.num_free_blocks == 64
    scheduler.kv_cache.check_integrity()


def test_retention_yields_when_the_idle_engine_cannot_fit_a_waiting_request() -> None:
    scheduler = scheduler_of(40, retention_share_per_owner=0.5)
    run(scheduler, retained(tokens(320, start=1000), 600))  # 20 of 40 blocks retained
    run(scheduler, make_request(tokens(560, start=90_000), max_tokens=1))  # needs 36
    assert scheduler.kv_cache.retention.num_blocks == 0
    assert scheduler.kv_cache.num_free_blocks == 40


@pytest.mark.parametrize("share", [-0.1])
def test_negative_bounds_are_refused(share: float) -> None:
    with pytest.raises(ValueError, match="retention bounds"):
        scheduler_of(10, retention_share_per_owner=share)
