"""Latency targets on the real model (SmolLM2-135M), counted in steps, not wall time: a flex flood
does not delay a priority request under the slo policy (and admission predicts no queue for it);
the slo policy's chunks keep decodes streaming every step at the planned size with the same greedy
output; a reserved share gets its project's prompt through a flood of another project's."""

from __future__ import annotations

from typing import Any

import pytest

from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.slo import HEADROOM
from engine.step_cost import StepCost, StepCostModel
from tests.engine.fakes import (
    Completion,
    assert_idle_and_clean,
    drive,
    drive_to_first_tokens,
    generate,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def build(model_path: str, checkpoint: Any, tokenizer: Any) -> Any:
    from engine.model_runner import ModelRunner

    def make(**scheduler: Any) -> LLMEngine:
        config = EngineConfig(model_path=model_path, num_threads=1, dtype="float32",
                              cache=CacheConfig(kv_cache_memory_bytes=64 << 20,
                                                enable_prefix_caching=False),
                              scheduler=SchedulerConfig(**scheduler))
        runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights),
                             dict(checkpoint.raw))
        return LLMEngine(config, checkpoint.config, runner, tokenizer)

    return make


def test_a_flex_flood_does_not_delay_a_priority_request_under_the_slo_policy(
        build: Any, tokenizer: Any) -> None:
    engine = build(max_num_batched_tokens=128, max_num_seqs=4, ttft_p90_ms=60_000.0,
                   tpot_p90_ms=60_000.0, policy="slo")
    urgent_prompt = tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    alone = generate(engine, {"alone": urgent_prompt}, GREEDY)["alone"]
    for i in range(8):
        engine.add_request(f"flex-{i}", tokenizer.encode_chat(
            [{"role": "user", "content": f"Count to {i + 3}, slowly."}]), GREEDY, priority=1)
    admissions = {}

    def on_step(index: int) -> None:
        if index == 3:  # every seat taken by flex requests, four more waiting
            admissions["priority"] = engine.admission(-1, len(urgent_prompt))
            admissions["flex"] = engine.admission(1, len(urgent_prompt))
            engine.add_request("urgent", urgent_prompt, GREEDY, priority=-1)

    first_token_step, results = drive_to_first_tokens(engine, on_step)
    assert first_token_step["urgent"] == 3  # the step right after it arrived
    assert admissions["priority"].is_admitted and admissions["priority"].queue_ms == 0.0
    # the flood's prompts are ahead of another flex request
    assert admissions["flex"].queue_ms > 0.0
    assert results["urgent"].token_ids == alone.token_ids
    assert engine.scheduler.step_costs.cost is not None  # measured from the steps it ran
    assert_idle_and_clean(engine)


class _FixedCosts(StepCostModel):
    """A step-time model that does not learn: the plan is then a function of the step's decodes."""

    def __init__(self, cost: StepCost) -> None:
        super().__init__()
        self.cost = cost

    def observe(self, num_prefill_tokens: int, num_decode_seqs: int, step_s: float,
                num_attention_pairs: int = 0) -> None:
        pass


def test_the_slo_policy_sizes_prefill_chunks_so_decodes_keep_the_tpot_target(
        build: Any, tokenizer: Any) -> None:
    cost = StepCost(base_s=0.010, prefill_s_per_token=0.001, decode_s_per_seq=0.002)
    tpot_target_ms = 50.0
    long_prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)[:120]
    streams = {f"s{i}": tokenizer.encode_chat([{"role": "user", "content": f"Tell me about {i}."}])
               for i in range(4)}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(policy: str) -> tuple[list[tuple[int, int]], dict[str, Completion]]:
        engine = build(max_num_batched_tokens=256, max_num_seqs=8, tpot_p90_ms=tpot_target_ms,
                       policy=policy)
        engine.scheduler.step_costs = _FixedCosts(cost)
        for request_id, prompt in streams.items():
            engine.add_request(request_id, prompt, params)
        steps: list[tuple[int, int]] = []  # (decodes, long prompt's chunk) per step of its prefill
        original = engine.scheduler.schedule

        def schedule() -> Any:
            batch = original()
            chunk = {s.request_id: s.num_scheduled_tokens for s in batch.sequences}
            if "long" in chunk and chunk["long"] > 1:
                steps.append((sum(1 for n in chunk.values() if n == 1), chunk["long"]))
            return batch

        engine.scheduler.schedule = schedule  # type: ignore[method-assign]

        def on_step(index: int) -> None:
            running = engine.scheduler.running
            if ("long" not in engine._requests and not steps and len(running) == 4
                    and all(r.num_output_tokens >= 1 for r in running)):  # the four streams decode
                engine.add_request("long", long_prompt, GREEDY)

        results = drive(engine, on_step=on_step)
        assert_idle_and_clean(engine)
        return steps, results

    slo_steps, slo_results = run("slo")
    fixed_steps, fixed_results = run("fixed")
    assert fixed_steps == [(4, 120)]  # the fixed budget prefills it at once: a 138 ms step
    assert len(slo_steps) > 1
    for num_decodes, chunk in slo_steps:
        assert num_decodes == 4  # every stream got its token in every step of the prefill
        assert cost.step_s(chunk, num_decodes) <= tpot_target_ms / 1000.0 * HEADROOM + 1e-9
        # (40 - 10 - 8) ms of prefill
        assert chunk == 22 or chunk == 120 - 22 * (len(slo_steps) - 1)
    assert sum(chunk for _, chunk in slo_steps) == 120
    assert {k: v.token_ids for k, v in slo_results.items()} == {
        k: v.token_ids for k, v in fixed_results.items()}


def test_a_reserved_share_gets_its_projects_prompt_through_another_projects_flood(
        build: Any, tokenizer: Any) -> None:
    acme_prompt = tokenizer.encode("Acme's question about rockets and roadrunners. " * 8)[:64]
    flood = [tokenizer.encode(f"Another project's long document number {i}. " * 30)[:128]
             for i in range(3)]

    def first_token_step(shares: tuple[tuple[str, float], ...]) -> tuple[int, Completion]:
        engine = build(max_num_batched_tokens=64, max_num_seqs=8, reserved_shares=shares)
        for i, prompt in enumerate(flood):
            engine.add_request(f"other-{i}", prompt, GREEDY, cache_salt="project:other")
        engine.add_request("acme", acme_prompt, GREEDY, cache_salt="project:acme")
        steps, results = drive_to_first_tokens(engine, lambda index: None)
        assert_idle_and_clean(engine)
        return steps["acme"], results["acme"]

    reserved_step, reserved = first_token_step((("acme", 0.5),))
    unreserved_step, unreserved = first_token_step(())
    assert reserved_step == 64 // 32 - 1  # 32 of every step's 64 tokens from the first step
    assert unreserved_step >= (384 + 64) // 64 - 1  # behind the flood's 384 tokens
    assert reserved.token_ids == unreserved.token_ids
