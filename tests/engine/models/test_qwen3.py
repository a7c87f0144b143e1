"""Qwen3 and Qwen3-MoE, served by the engine from tiny random checkpoints that transformers wrote:
greedy tokens equal transformers' and their logprobs agree within 2e-3 (float32), alone, with the
prompt prefilled in chunks, among 8 concurrent requests, after a prefix-cache hit and under
preemption; every KV block comes back."""

from __future__ import annotations

import functools

import pytest

from contracts.sampling_params import SamplingParams
from engine.engine import LLMEngine
from tests.engine.fakes import assert_idle_and_clean, generate
from tests.engine.models import _serving_checks as serving
from tests.engine.models._qwen3 import VARIANTS, TinyCheckpoint
from tests.engine.models._serving_checks import (
    EngineFactory,
    assert_matches_transformers,
)

NUM_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=True)
TARGET = ("Tell me one fact about the moon and the sea, then one about bread, jazz, chess, rain "
          "and bees. def prime(n): return all(n % d for d in range(2, n))")
OTHERS = ["the quick brown fox", "jazz", "tell me about rain and bees " * 3, "chess, bread",
          "def prime(n): return n", "the lazy dog jumps over the moon " * 2, "sea"]


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest, qwen3_checkpoints: dict[str, TinyCheckpoint]
            ) -> TinyCheckpoint:
    return qwen3_checkpoints[request.param]


@pytest.fixture(scope="module")
def make_engine(variant: TinyCheckpoint) -> EngineFactory:
    return functools.partial(serving.make_engine, variant.directory, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    """32 tokens a step: the target prompt prefills in several chunks."""
    return make_engine()


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> dict[str, list[int]]:
    encoded = serving.encode_chat_prompts(engine, TARGET, OTHERS)
    assert len(encoded["target"]) > 2 * 32  # prefilled in 3 or more chunks of the step budget
    return encoded


@pytest.fixture(scope="module")
def expected(variant: TinyCheckpoint,
             prompts: dict[str, list[int]]) -> tuple[list[int], list[float]]:
    return serving.transformers_reference(variant.model, prompts["target"], NUM_NEW_TOKENS)


def test_greedy_tokens_and_logprobs_equal_transformers_with_chunked_prefill(
        engine: LLMEngine, prompts: dict[str, list[int]],
        expected: tuple[list[int], list[float]]) -> None:
    result = generate(engine, {"target": prompts["target"]}, GREEDY)["target"]
    assert_matches_transformers(result, expected)
    assert_idle_and_clean(engine)
    from engine.kernels import cpu as native
    if native.load() and not engine.model_config.is_moe:  # decode rows took the native float step
        assert engine.runner._native_decode is not None


def test_same_tokens_among_8_concurrent_requests_and_after_a_prefix_cache_hit(
        engine: LLMEngine, prompts: dict[str, list[int]],
        expected: tuple[list[int], list[float]]) -> None:
    serving.check_same_tokens_together_and_after_a_prefix_hit(engine, prompts, expected, GREEDY)


def test_outputs_under_preemption_equal_the_roomy_engines(
        engine: LLMEngine, make_engine: EngineFactory, prompts: dict[str, list[int]],
        expected: tuple[list[int], list[float]]) -> None:
    total_blocks = sum(-(-(len(p) + 24) // 16) for p in prompts.values())  # half of what all need
    serving.check_preemption_matches_roomy(engine, make_engine, prompts, expected[0],
                                           num_blocks=total_blocks // 2)
