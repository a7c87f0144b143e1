"""Admission's prediction counts what the prefix cache holds and the wait for a seat
(engine/slo.py::queue_load_of, predict_queue_s): pure parts on fake requests, then the real engine's
cached-prefix lookup (SmolLM2-135M, counted in tokens, never timed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from contracts.sampling_params import SamplingParams
from engine.admission import predict_admission, predict_queue_s, queue_load_of, seat_wait_steps
from engine.slo import StepPlan
from engine.step_cost import StepCost

COST = StepCost(base_s=0.010, prefill_s_per_token=0.0001, decode_s_per_seq=0.001)


@dataclass
class FakeRequest:
    priority: int
    num_tokens: int
    num_computed_tokens: int = 0
    num_cached_tokens_predicted: int = 0
    max_num_tokens: int = 0


def _decoding(priority: int, remaining_output: int) -> FakeRequest:
    return FakeRequest(priority, 100, num_computed_tokens=99, max_num_tokens=100 + remaining_output)


def test_a_waiting_request_counts_only_its_uncached_tokens() -> None:
    waiting = [FakeRequest(0, 1000, num_cached_tokens_predicted=896), FakeRequest(0, 200)]
    load = queue_load_of(waiting, [], StepPlan(512, 64), COST)
    assert load.by_class[0].num_prefill_tokens == 104 + 200
    assert load.by_class[0].num_waiting == 2 and load.by_class[-1].num_waiting == 0
    # a whole prompt cached still computes its last token
    full = queue_load_of([FakeRequest(0, 64, num_cached_tokens_predicted=64)], [],
                         StepPlan(512, 64), COST)
    assert full.by_class[0].num_prefill_tokens == 1


def test_a_cached_prompt_predicts_a_shorter_prefill_and_is_admitted() -> None:
    load = queue_load_of([FakeRequest(0, 4000)], [], StepPlan(512, 64), COST)
    _, own_uncached = predict_queue_s(load, 0, 6000)
    _, own_cached = predict_queue_s(load, 0, 6000, num_cached_tokens=5888)
    assert own_cached < own_uncached / 10
    step_s = COST.step_s(512, 0)
    queue_ms, own_ms = 4000 / 512 * step_s * 1000.0, 6000 / 512 * step_s * 1000.0
    target_ms = (queue_ms + own_ms + own_ms) / 2  # above its own prefill, below queue + prefill
    assert own_ms < target_ms < queue_ms + own_ms
    assert not predict_admission(load, 0, 6000, target_ms).is_admitted
    assert predict_admission(load, 0, 6000, target_ms, num_cached_tokens=5888).is_admitted


def test_a_full_batch_makes_a_new_request_wait_for_the_soonest_seats() -> None:
    running = [_decoding(0, n) for n in (40, 5, 90, 12)]
    load = queue_load_of([], running, StepPlan(512, 4), COST)
    assert load.by_class[0].seat_free_steps == (5, 12, 40, 90)
    assert seat_wait_steps(load, load.by_class[0]) == 5  # the soonest to finish frees its seat
    queue_s, _ = predict_queue_s(load, 0, 10)
    assert queue_s == pytest.approx(5 * COST.step_s(512 - 4, 4))
    # two requests already waiting take the first two seats: a third waits for the third
    waited = queue_load_of([FakeRequest(0, 10), FakeRequest(0, 10)], running, StepPlan(512, 4),
                           COST)
    assert seat_wait_steps(waited, waited.by_class[0]) == 40
    # a seat free: no wait
    roomy = queue_load_of([], running, StepPlan(512, 5), COST)
    assert seat_wait_steps(roomy, roomy.by_class[0]) == 0
    assert predict_queue_s(roomy, 0, 10)[0] == 0.0


def test_seats_held_by_a_lower_class_do_not_make_a_higher_one_wait() -> None:
    running = [_decoding(1, 200) for _ in range(3)] + [_decoding(-1, 30)]
    load = queue_load_of([], running, StepPlan(512, 4), COST)
    assert seat_wait_steps(load, load.ahead_of(-1)) == 0  # flex gives its seat up to priority
    assert seat_wait_steps(load, load.ahead_of(0)) == 0  # and to default
    assert seat_wait_steps(load, load.ahead_of(1)) == 30  # flex waits for the soonest of all
    assert load.ahead_of(1).seat_free_steps == (30, 200, 200, 200)
    # a refusal for a seat carries the wait as its Retry-After basis
    slow = StepCost(base_s=0.5, prefill_s_per_token=0.0, decode_s_per_seq=0.0)
    refused = predict_admission(queue_load_of([], running, StepPlan(512, 4), slow), 1, 10,
                                ttft_target_ms=1000.0)
    assert not refused.is_admitted and refused.queue_ms == pytest.approx(30 * 500.0)
    assert refused.retry_after_s == 15


@pytest.fixture(scope="module")
def caching_engine(model_path: str, checkpoint: Any, tokenizer: Any) -> Any:
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine
    from engine.model_runner import ModelRunner

    config = EngineConfig(model_path=model_path, num_threads=1, dtype="float32",
                          cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
                          scheduler=SchedulerConfig(ttft_p90_ms=60_000.0, tpot_p90_ms=60_000.0))
    runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))
    return LLMEngine(config, checkpoint.config, runner, tokenizer)


def test_the_engine_finds_a_prompts_cached_prefix_for_admission(caching_engine: Any,
                                                                tokenizer: Any) -> None:
    from tests.engine.fakes import generate

    engine = caching_engine
    block = engine.block_size
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    assert len(prompt) > 3 * block
    assert engine.num_cached_prefix_tokens(prompt, "project:a") == 0
    generate(engine, {"first": prompt},
             SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), cache_salt="project:a")
    expected = (len(prompt) - 1) // block * block  # every full block but the last token's
    assert engine.num_cached_prefix_tokens(prompt, "project:a") == expected
    assert engine.num_cached_prefix_tokens(prompt + [11, 12], "project:a") == expected
    assert engine.num_cached_prefix_tokens(prompt, "project:b") == 0  # another tenant's cache
    assert engine.num_cached_prefix_tokens(prompt[: block // 2], "project:a") == 0
    # a queued request carries the hit it found, and the load counts only the rest
    engine.add_request("again", prompt + [11, 12], SamplingParams(max_tokens=1),
                       cache_salt="project:a")
    engine.publish_load()
    assert engine.scheduler.waiting[0].num_cached_tokens_predicted == expected
    assert engine.queue_load.by_class[0].num_prefill_tokens == len(prompt) + 2 - expected
    engine.abort_request("again")
    engine.publish_load()
    assert engine.queue_load.by_class[0].num_prefill_tokens == 0
