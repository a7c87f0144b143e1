"""Scheduler + KVCacheManager driven directly with fake requests; "compute" appends one token per
sampled row (tests/engine/fakes.py). No model."""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.outputs import FinishReason
from engine.request import RequestStatus
from engine.scheduler import Scheduler
from tests.engine.fakes import make_manager, make_request, run_to_completion, simulate_step, tokens


def make_scheduler(num_blocks: int = 256, max_num_batched_tokens: int = 64,
                   max_num_seqs: int | None = None,
                   prefix_aware_window: int = 8, enable_caching: bool = True) -> Scheduler:
    # The config requires a token of budget per running sequence: by default as many sequences as
    # that.
    if max_num_seqs is None:
        max_num_seqs = min(64, max_num_batched_tokens)
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                             max_num_seqs=max_num_seqs, prefix_aware_window=prefix_aware_window)
    return Scheduler(config, make_manager(num_blocks, enable_caching))


def test_every_step_respects_the_token_budget_and_every_request_finishes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=50)
    requests = [make_request(tokens(n, start=1000 * n), max_tokens=5)
                for n in (3, 70, 20, 120, 49, 1)]
    for request in requests:
        scheduler.add_request(request)
    batches = run_to_completion(scheduler)
    assert all(0 < batch.num_scheduled_tokens <= 50 for batch in batches)
    assert all(r.status == RequestStatus.FINISHED and r.num_output_tokens == 5 for r in requests)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_running_decodes_are_scheduled_before_new_prefills() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    streaming = make_request(tokens(10), max_tokens=50)
    scheduler.add_request(streaming)
    simulate_step(scheduler, scheduler.schedule())  # prefill, first token
    newcomer = make_request(tokens(200, start=5000))
    scheduler.add_request(newcomer)
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.sequences] == [streaming.request_id, newcomer.request_id]
    assert batch.sequences[0].num_scheduled_tokens == 1
    assert batch.sequences[1].num_scheduled_tokens == 63


def test_chunked_prefill_splits_a_long_prompt_while_decodes_continue_every_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=100)
    streaming = make_request(tokens(10), max_tokens=100)
    scheduler.add_request(streaming)
    simulate_step(scheduler, scheduler.schedule())
    long_prompt = make_request(tokens(1000, start=5000), max_tokens=3)
    scheduler.add_request(long_prompt)
    chunk_sizes = []
    while long_prompt.num_output_tokens == 0:
        batch = scheduler.schedule()
        by_id = {s.request_id: s for s in batch.sequences}
        assert by_id[streaming.request_id].num_scheduled_tokens == 1  # the stream never stalls
        chunk = by_id[long_prompt.request_id]
        assert chunk.start_position == sum(chunk_sizes)
        assert chunk.needs_sample == (chunk.seq_len == 1000)
        chunk_sizes.append(chunk.num_scheduled_tokens)
        before = streaming.num_output_tokens
        simulate_step(scheduler, batch)
        assert streaming.num_output_tokens == before + 1
        scheduler.kv_cache.check_integrity()
    assert sum(chunk_sizes) == 1000
    assert len(chunk_sizes) == 11 and max(chunk_sizes) == 99  # ceil(1000 / 99)


def test_max_num_seqs_caps_the_running_batch() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=512, max_num_seqs=3)
    requests = [make_request(tokens(5, start=100 * i), max_tokens=4) for i in range(8)]
    for request in requests:
        scheduler.add_request(request)
    for batch in run_to_completion(scheduler):
        assert len(batch.sequences) <= 3
        assert len(scheduler.running) <= 3
    assert all(r.is_finished for r in requests)


def test_arrivals_join_at_the_next_step_and_finished_requests_leave_at_once() -> None:
    scheduler = make_scheduler()
    first = make_request(tokens(4), max_tokens=2)
    scheduler.add_request(first)
    simulate_step(scheduler, scheduler.schedule())
    second = make_request(tokens(4, start=50), max_tokens=2)
    scheduler.add_request(second)
    batch = scheduler.schedule()
    assert {s.request_id for s in batch.sequences} == {first.request_id, second.request_id}
    finished = simulate_step(scheduler, batch)
    assert finished == [first]
    assert scheduler.running == [second]
    assert first.finish_reason == FinishReason.LENGTH
    assert scheduler.kv_cache.block_ids(second.request_id)
    assert scheduler.kv_cache.num_requests == 1


def test_youngest_request_is_preempted_when_blocks_run_out_and_later_completes() -> None:
    # 6 blocks; two requests of 30 prompt tokens growing to 70 tokens each need 10 blocks together.
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=128, enable_caching=False)
    old = make_request(tokens(30), max_tokens=40, request_id="old")
    young = make_request(tokens(30, start=900), max_tokens=40, request_id="young")
    scheduler.add_request(old)
    scheduler.add_request(young)
    preempted: list[str] = []
    for _ in range(500):
        if not scheduler.num_unfinished:
            break
        batch = scheduler.schedule()
        preempted.extend(batch.preempted_request_ids)
        if batch.preempted_request_ids:
            victim = young if "young" in batch.preempted_request_ids else old
            assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
            assert scheduler.waiting[0] is victim
        simulate_step(scheduler, batch)
        scheduler.kv_cache.check_integrity()
    assert preempted and preempted[0] == "young"
    assert young.num_preemptions >= 1 and scheduler.num_preemptions_total == len(preempted)
    for request in (old, young):
        assert request.is_finished and request.num_output_tokens == 40
    assert scheduler.kv_cache.num_free_blocks == 6


def test_preempted_request_recomputes_its_output_tokens_too() -> None:
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=128, enable_caching=False)
    old = make_request(tokens(30), max_tokens=40)
    young = make_request(tokens(30, start=900), max_tokens=40)
    scheduler.add_request(old)
    scheduler.add_request(young)
    while young.num_preemptions == 0:
        simulate_step(scheduler, scheduler.schedule())
    num_tokens_at_preemption = young.num_tokens
    while young.status != RequestStatus.RUNNING:
        batch = scheduler.schedule()
        simulate_step(scheduler, batch)
    resumed = next(s for s in batch.sequences if s.request_id == young.request_id)
    assert resumed.start_position == 0
    assert (resumed.token_ids
            == (young.prompt_token_ids + young.output_token_ids)[:len(resumed.token_ids)])
    assert young.num_tokens >= num_tokens_at_preemption


def test_prefix_aware_admission_prefers_the_cached_request_within_the_window() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4096)
    shared = tokens(64, start=7000)
    scheduler.add_request(make_request(shared + [1], max_tokens=1))
    run_to_completion(scheduler)  # leaves 4 cached blocks behind
    cold = make_request(tokens(65, start=100), max_tokens=1)
    warm = make_request(shared + [2], max_tokens=1)
    scheduler.add_request(cold)
    scheduler.add_request(warm)
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.sequences] == [warm.request_id, cold.request_id]
    assert warm.num_cached_tokens == 64 and batch.sequences[0].num_scheduled_tokens == 1


def test_prefix_aware_admission_never_passes_over_the_head_more_than_the_window() -> None:
    window = 3
    scheduler = make_scheduler(max_num_batched_tokens=1, prefix_aware_window=window)
    shared = tokens(32, start=7000)
    scheduler.add_request(make_request(shared + [1], max_tokens=1))
    run_to_completion(scheduler)
    cold = make_request(tokens(33, start=100), max_tokens=1, request_id="cold")
    scheduler.add_request(cold)
    admitted = []
    for i in range(10):  # a steady stream of cache hits keeps arriving behind the cold head
        scheduler.add_request(make_request(shared + [10 + i], max_tokens=1, request_id=f"warm-{i}"))
    while cold.status == RequestStatus.WAITING:
        running_before = {r.request_id for r in scheduler.running}
        batch = scheduler.schedule()
        admitted += [s.request_id for s in batch.sequences if s.request_id not in running_before]
        simulate_step(scheduler, batch)
        for request in list(scheduler.running):  # keep the budget free for admissions
            if request is not cold:
                scheduler.finish(request, FinishReason.ABORT)
        scheduler.kv_cache.check_integrity()
    assert admitted == ["warm-0", "warm-1", "warm-2", "cold"]


def test_prefix_cache_statistics_count_each_admitted_request_once() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=512, max_num_seqs=1)
    shared = tokens(48, start=7000)
    requests = [make_request(shared + [i], max_tokens=3) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    # one at a time (max_num_seqs=1): the others wait, looked up each step
    run_to_completion(scheduler)
    manager = scheduler.kv_cache
    assert [r.num_cached_tokens for r in requests] == [0, 48, 48, 48]
    assert manager.num_hit_tokens == sum(r.num_cached_tokens for r in requests)
    assert manager.num_queried_tokens == sum(r.num_prompt_tokens for r in requests)


def test_config_refuses_a_budget_smaller_than_the_number_of_running_sequences() -> None:
    import pytest

    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16)


def test_with_a_ttft_target_the_head_is_not_passed_over_for_the_last_free_seat() -> None:
    def admitted_order(ttft_p90_ms: float | None, max_num_seqs: int) -> list[str]:
        config = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=max_num_seqs,
                                 prefix_aware_window=8, ttft_p90_ms=ttft_p90_ms)
        scheduler = Scheduler(config, make_manager(256, enable_caching=True))
        shared = tokens(64, start=7000)
        scheduler.add_request(make_request(shared + [1], max_tokens=1))
        run_to_completion(scheduler)  # leaves 4 cached blocks behind
        streaming = make_request(tokens(8, start=50), max_tokens=20, request_id="streaming")
        scheduler.add_request(streaming)
        simulate_step(scheduler, scheduler.schedule())  # it holds a seat from here on
        scheduler.add_request(make_request(tokens(65, start=100), max_tokens=1, request_id="cold"))
        scheduler.add_request(make_request(shared + [2], max_tokens=1, request_id="warm"))
        batch = scheduler.schedule()
        return [s.request_id for s in batch.sequences if s.request_id != "streaming"]

    # one seat free: the head takes it (FIFO, as admission predicted); without a target, or with
    # seats for both, the cache hit goes first
    assert admitted_order(3000.0, max_num_seqs=2) == ["cold"]
    assert admitted_order(None, max_num_seqs=2) == ["warm"]
    assert admitted_order(3000.0, max_num_seqs=3) == ["warm", "cold"]
