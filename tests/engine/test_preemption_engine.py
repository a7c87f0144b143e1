"""Preemption on the real model (SmolLM2-135M, float32), counted in steps, never timed: a reserved
project's burst arriving after another project filled the KV pool and every seat takes its share
back; a priority request arriving into a full KV pool preempts flex requests; a flex request under
a steady default stream ages into default and finishes within its bound. The preempted requests
resume and finish with the greedy tokens they produce unpreempted, their usage counted once, and
every block is free at the end. One engine (12 KV blocks, 5 seats, 64 tokens a step, a virtual
clock) serves every test."""

from __future__ import annotations

from typing import Any

import pytest

from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from tests.engine.fakes import Completion, assert_idle_and_clean, drive_to_first_tokens, generate

NUM_BLOCKS = 12  # 192 token slots: the four fillers (40 prompt + 8 output tokens) take every one
FILLER = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
STREAM = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
FLEX_MAX_WAIT_MS = 4_000.0  # 4 steps of the virtual clock


class VirtualClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture(scope="module")
def clock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture(scope="module")
def engine(model_path: str, checkpoint: Any, tokenizer: Any, clock: VirtualClock) -> LLMEngine:
    from engine.model_runner import ModelRunner

    model = checkpoint.config
    # K+V, float32
    block_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 16 * 4
    config = EngineConfig(
        model_path=model_path, num_threads=1, dtype="float32",
        cache=CacheConfig(kv_cache_memory_bytes=NUM_BLOCKS * block_bytes,
                          enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=5,
                                  reserved_shares=(("acme", 0.5),),
                                  flex_max_wait_ms=FLEX_MAX_WAIT_MS))
    runner = ModelRunner(config, model, dict(checkpoint.weights), dict(checkpoint.raw))
    engine = LLMEngine(config, model, runner, tokenizer, clock=clock)
    assert engine.kv_cache.num_blocks == NUM_BLOCKS
    return engine


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> dict[str, list[int]]:
    fillers = {f"other-{i}": tokenizer.encode(f"Document {i}: the tides, the moon and the harbour. "
                                              * 8)[:40]
               for i in range(4)}
    short = {f"acme-{i}": tokenizer.encode(f"Acme question {i}: why is the sky blue at noon? "
                                           * 3)[:20]
             for i in range(2)}
    short["urgent"] = tokenizer.encode("An urgent question about the harbour master's boat. "
                                       * 3)[:24]
    return {**fillers, **short}


@pytest.fixture(scope="module")
def unpreempted(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, Completion]:
    """Every prompt's greedy output with nothing preempted: the fillers together (they fit the
    pool exactly), the short ones together."""
    results = generate(engine, {k: v for k, v in prompts.items() if k.startswith("other")}, FILLER)
    results.update(generate(engine, {k: v for k, v in prompts.items() if not k.startswith("other")},
                            SHORT))
    assert engine.scheduler.num_preemptions_total == 0
    assert_idle_and_clean(engine)
    return results


def _fill_then_burst(engine: LLMEngine, prompts: dict[str, list[int]], filler_salt: str | None,
                     filler_class: int, burst: tuple[str, ...], burst_salt: str | None,
                     burst_class: int) -> tuple[int, dict[str, int], dict[str, Completion]]:
    """The four fillers first; the burst arrives once they all decode and hold every block.
    Returns the burst's arrival step, each request's first-token step and the results."""
    fillers = [k for k in prompts if k.startswith("other")]
    for request_id in fillers:
        engine.add_request(request_id, prompts[request_id], FILLER, cache_salt=filler_salt,
                           priority=filler_class)
    arrival: list[int] = []

    def on_step(index: int) -> None:
        running = engine.scheduler.running
        if not arrival and len(running) == 4 and all(r.num_output_tokens >= 2 for r in running):
            assert engine.kv_cache.num_free_blocks == 0
            for request_id in burst:
                engine.add_request(request_id, prompts[request_id], SHORT, cache_salt=burst_salt,
                                   priority=burst_class)
            arrival.append(index)

    first_token_step, results = drive_to_first_tokens(engine, on_step)
    assert arrival, "the burst never arrived"
    # resumed where they stopped: the same tokens, the prompt billed once
    for request_id in fillers:
        assert results[request_id].token_ids == unpreempted_tokens(request_id)
        assert results[request_id].num_prompt_tokens == len(prompts[request_id])
        assert results[request_id].num_cached_tokens == 0
    return arrival[0], first_token_step, results


_reference: dict[str, list[int]] = {}


def unpreempted_tokens(request_id: str) -> list[int]:
    return _reference[request_id]


@pytest.fixture(autouse=True)
def _reference_tokens(unpreempted: dict[str, Completion]) -> None:
    _reference.update({k: v.token_ids for k, v in unpreempted.items()})


def test_a_reserved_projects_burst_takes_its_share_back_from_a_full_pool(
        engine: LLMEngine, prompts: dict[str, list[int]],
        unpreempted: dict[str, Completion]) -> None:
    before = engine.stats()
    arrived, first_token_step, results = _fill_then_burst(
        engine, prompts, "project:other", 0, ("acme-0", "acme-1"), "project:acme", 0)
    # acme holds half the pool and two of the five seats: the two youngest fillers make room,
    # and both of its prompts run in the very step after the burst arrived
    assert first_token_step["acme-0"] == first_token_step["acme-1"] == arrived
    after = engine.stats()  # (aigw_replica_preemptions_total, _reserved_share_preemptions_total)
    assert after.num_preemptions_total - before.num_preemptions_total == 2
    assert after.num_share_preemptions_total - before.num_share_preemptions_total == 2
    assert all(results[r].token_ids == unpreempted[r].token_ids for r in ("acme-0", "acme-1"))
    assert_idle_and_clean(engine)


def test_a_priority_request_preempts_flex_requests_for_kv_room(
        engine: LLMEngine, prompts: dict[str, list[int]],
        unpreempted: dict[str, Completion]) -> None:
    before = engine.scheduler.num_preemptions_total
    arrived, first_token_step, results = _fill_then_burst(engine, prompts, None, 1, ("urgent",),
                                                          None, -1)
    assert first_token_step["urgent"] == arrived  # a seat was free; the KV pool was not
    assert engine.scheduler.num_preemptions_total - before == 1
    assert results["urgent"].token_ids == unpreempted["urgent"].token_ids
    assert_idle_and_clean(engine)


def test_a_flex_request_under_a_steady_default_stream_finishes_within_its_aging_bound(
        engine: LLMEngine, tokenizer: Any, clock: VirtualClock) -> None:
    # five default requests of 1..5 tokens take the five seats at step 0, and from step 1 a default
    # request of 5 tokens (five steps of a seat) arrives every step: each step one seat frees and
    # a default request is waiting for it. The flex request arrives at step 0 behind them.
    base_s, num_stream = clock.now_s + 1000.0, 10
    say = {i: tokenizer.encode(f"Say the number {i}.") for i in range(num_stream + 5)}

    def on_step(index: int) -> None:
        clock.now_s = base_s + index  # one virtual second per step
        if index == 0:
            for i in range(5):
                engine.add_request(f"default-{i}", say[i], SamplingParams(
                    temperature=0.0, max_tokens=i + 1, ignore_eos=True))
            engine.add_request("flex",
                               tokenizer.encode("A flex question, no hurry: what is a harbour?"),
                               SHORT, priority=1)
        elif index <= num_stream:
            engine.add_request(f"default-{index + 4}", say[index + 4], STREAM)

    promoted_before = engine.stats().num_flex_promotions_total
    first_token_step, results = drive_to_first_tokens(engine, on_step)
    # past its 4 s bound (step 5) it goes ahead of the defaults that arrived after it
    assert FLEX_MAX_WAIT_MS / 1000.0 < first_token_step["flex"] <= FLEX_MAX_WAIT_MS / 1000.0 + 2
    assert first_token_step["flex"] + 3 < num_stream  # finished while the stream still ran
    assert len(results["flex"].token_ids) == 4
    assert [len(results[f"default-{i}"].token_ids) for i in range(5)] == [1, 2, 3, 4, 5]
    assert all(len(results[f"default-{i + 4}"].token_ids) == 5 for i in range(1, num_stream + 1))
    # aigw_replica_flex_promotions_total
    assert engine.stats().num_flex_promotions_total - promoted_before == 1
    assert_idle_and_clean(engine)
