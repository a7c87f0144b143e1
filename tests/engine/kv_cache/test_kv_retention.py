"""Retention: a finished request's cached prompt blocks kept safe from LRU eviction for its
retention time, bounded per owner (cache salt) and in all, superseded by the same session's next
retention, never kept for an abort, never stalling an idle engine; check_integrity counts retention
references."""

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
        # 10 blocks each
        run(scheduler, retained(kept, retain_s), make_request(plain, max_tokens=1))
        # 50 blocks: evicts LRU
        run(scheduler, make_request(tokens(800, start=50_000), max_tokens=1))
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


def test_retention_runs_on_the_schedulers_clock() -> None:
    now_s = [1000.0]  # a virtual clock (bench/agent_pauses.py): wall time plays no part
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16),
                          make_manager(64), clock=lambda: now_s[0])
    request = retained(tokens(96), 30.0)
    run(scheduler, request)
    assert request.first_scheduled_time == 1000.0
    table = scheduler.kv_cache.retention
    for now_s[0], expected in ((1029.99, 6), (1030.0, 0)):
        scheduler.schedule()
        assert table.num_blocks == expected, now_s[0]
    scheduler.kv_cache.check_integrity()


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


def test_sessions_sharing_a_head_keep_it_once_and_count_it_once() -> None:
    scheduler = scheduler_of(200)  # 50 blocks per owner
    head = tokens(320, start=1000)  # 20 blocks every session shares (system prompt and tools)
    sessions = [retained(head + tokens(48, start=10_000 + 1000 * i), 600, salt="p", session=f"s{i}")
                for i in range(8)]
    run(scheduler, *sessions)
    table = scheduler.kv_cache.retention
    assert table.num_entries == 8 and table.num_blocks_of("p") == 20 + 8 * 3  # head once
    assert all(b.ref_cnt == 1 for b in table.references())  # one pool reference a distinct block
    scheduler.kv_cache.check_integrity()
    table.release_all()
    assert scheduler.kv_cache.num_free_blocks == 200
    scheduler.kv_cache.check_integrity()


def test_a_next_turn_without_a_session_id_supersedes_the_prefix_it_extends() -> None:
    scheduler = scheduler_of(200)
    turn1 = tokens(160, start=1000)
    other = tokens(160, start=1000)[:96] + tokens(64, start=60_000)  # shares 6 blocks of head only
    run(scheduler, retained(turn1, 600), retained(other, 600))
    table = scheduler.kv_cache.retention
    assert table.num_entries == 2 and table.num_blocks == 10 + 4
    # turn 1's prompt, answer, more
    turn2 = turn1 + tokens(2, start=3000) + tokens(62, start=70_000)
    run(scheduler, retained(turn2, 600))
    assert table.num_entries == 2  # turn 1's entry gone, the other session's kept
    assert num_cached_blocks_of(scheduler, other) == 10
    scheduler.kv_cache.check_integrity()


def test_retention_events_name_the_kept_hashes_and_replaying_events_stays_true() -> None:
    from contracts.kv_events import BlockRetained, KVEventLog, apply_events

    log = KVEventLog("r0")
    from engine.kv_cache.manager import KVCacheManager
    manager = KVCacheManager(40, BLOCK_SIZE, True, log, (None,), retention_share_per_owner=0.5)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16), manager)
    kept = retained(tokens(160, start=1000), 600)
    started = time.time()
    run(scheduler, kept)
    batch = log.seal()
    assert batch is not None
    events = [e for e in batch.events if isinstance(e, BlockRetained)]
    assert len(events) == 1 and events[0].block_hashes == tuple(kept.block_hashes[:10])
    assert started + 599 <= events[0].retained_until_ts <= time.time() + 601
    held: set[int] = set()
    apply_events(held, batch.events)
    for start in (20_000, 40_000, 60_000):  # pressure: 24 blocks each, 30 evictable
        run(scheduler, make_request(tokens(384, start=start), max_tokens=1))
        sealed = log.seal()
        if sealed is not None:
            apply_events(held, sealed.events)
        assert held == set(manager.pool.cached_hashes())  # what a consumer of the events holds
        assert set(kept.block_hashes[:10]) <= held
    manager.check_integrity()


def test_an_engine_clamps_retention_to_its_maximum_and_refuses_a_negative_one(
        make_engine) -> None:  # type: ignore[no-untyped-def]
    from contracts.sampling_params import SamplingParams
    from tests.engine.fakes import drive

    engine = make_engine(kv_cache_memory_bytes=16 << 20, fresh=True)  # 22 blocks
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match="retain_s"):
        engine.add_request("neg", tokens(40, start=100), params, retain_s=-1.0)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    engine.add_request("a", prompt, params, cache_salt="p1", retain_s=10 ** 9)
    drive(engine)
    table = engine.kv_cache.retention
    entry = next(iter(table._entries.values()))
    assert entry.expires_at_s <= time.monotonic() + engine.config.cache.max_retention_s
    assert table.num_blocks_of("p1") == len(prompt) // BLOCK_SIZE
    engine.kv_cache.check_integrity()
    engine.kv_cache.release_retention()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_on_the_real_engine_retention_expires_holds_its_project_bound_and_an_abort_leaks_nothing(
        make_engine) -> None:  # type: ignore[no-untyped-def]
    from contracts.sampling_params import SamplingParams
    from tests.engine.fakes import drive

    engine = make_engine(kv_cache_memory_bytes=16 << 20, fresh=True)  # 22 blocks: 5 a project
    manager, params = engine.kv_cache, SamplingParams(temperature=0.0, max_tokens=2)
    text = engine.tokenizer.encode("Harbour tide tables, berth rules and pilot schedules. " * 30)
    assert len(text) >= 230
    engine.add_request("short", text[:50], params, cache_salt="p1", retain_s=0.05)
    engine.add_request("long", text[50:150], params, cache_salt="p1", retain_s=600,
                       retention_id="s1")
    engine.add_request("other", text[150:230], params, cache_salt="p2", retain_s=600)
    drive(engine)
    bound = manager.retention.max_blocks_per_owner
    assert manager.retention.num_blocks_of("p1") == bound  # 3 + 6 blocks asked, the bound kept
    assert manager.retention.num_blocks_of("p2") == 5
    time.sleep(0.06)
    engine.add_request("abort-me", text[:120], params, retain_s=600)
    engine.step()  # (a step expires what is due) mid-prefill or decoding: then aborted
    engine.abort_request("abort-me")
    assert manager.retention.num_blocks_of("") == 0  # an abort retains nothing
    assert manager.retention.num_entries == 2  # the 0.05 s one expired
    manager.check_integrity()
    manager.release_retention()
    assert manager.num_free_blocks == manager.num_blocks  # no block leaked
    manager.check_integrity()


def test_a_waiting_request_takes_retained_blocks_soonest_expiring_first_while_others_run() -> None:
    from tests.engine.fakes import simulate_step

    scheduler = scheduler_of(50, retention_share_per_owner=0.5)
    run(scheduler, retained(tokens(160, start=1000), 100, session="soon"),
        retained(tokens(160, start=5000), 600, session="late"))  # 20 of 50 blocks retained
    running = make_request(tokens(320, start=20_000), max_tokens=50)  # 21 blocks, keeps running
    scheduler.add_request(running)
    for _ in range(3):  # its prefill (256 + 64 tokens), then decoding
        simulate_step(scheduler, scheduler.schedule())
    waiting = make_request(tokens(480, start=40_000), max_tokens=1)  # a 255-token chunk: 16 blocks
    scheduler.add_request(waiting)
    scheduler.schedule()  # 8 free: only with 10 retained blocks released does it fit
    assert waiting in scheduler.running and running in scheduler.running  # it did not wait
    table = scheduler.kv_cache.retention
    assert [key[1] for key in table._entries] == ["late"]  # the soonest to expire yielded
    scheduler.kv_cache.check_integrity()
