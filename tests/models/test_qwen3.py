"""Qwen3 and Qwen3-MoE, served by the engine from tiny random checkpoints that transformers wrote:
greedy tokens equal transformers' and their logprobs agree within 2e-3 (float32), alone, with the
prompt prefilled in chunks, among 8 concurrent requests, after a prefix-cache hit and under
preemption; every KV block comes back."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from tests.engine.fakes import Completion, assert_idle_and_clean, drive, generate
from tests.models._greedy import hf_greedy
from tests.models._qwen3 import VARIANTS, TinyCheckpoint

NUM_NEW_TOKENS = 12
LOGPROB_TOLERANCE = 2e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=True)
TARGET = ("Tell me one fact about the moon and the sea, then one about bread, jazz, chess, rain "
          "and bees. def prime(n): return all(n % d for d in range(2, n))")
OTHERS = ["the quick brown fox", "jazz", "tell me about rain and bees " * 3, "chess, bread",
          "def prime(n): return n", "the lazy dog jumps over the moon " * 2, "sea"]

EngineFactory = Callable[..., LLMEngine]


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest, qwen3_checkpoints: dict[str, TinyCheckpoint]
            ) -> TinyCheckpoint:
    return qwen3_checkpoints[request.param]


@pytest.fixture(scope="module")
def make_engine(variant: TinyCheckpoint) -> EngineFactory:
    def make(kv_cache_memory_bytes: int = 8 << 20, max_num_batched_tokens: int = 32,
             max_num_seqs: int = 16) -> LLMEngine:
        config = EngineConfig(
            model_path=str(variant.directory), num_threads=1, dtype="float32",
            cache=CacheConfig(kv_cache_memory_bytes=kv_cache_memory_bytes),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                      max_num_seqs=max_num_seqs))
        return LLMEngine.from_config(config, progress=False)

    return make


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    """32 tokens a step: the target prompt prefills in several chunks."""
    return make_engine()


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> dict[str, list[int]]:
    chat = engine.tokenizer.encode_chat
    encoded = {"target": chat([{"role": "user", "content": TARGET}])}
    encoded |= {f"other-{i}": chat([{"role": "user", "content": text}]) for i, text in enumerate(OTHERS)}
    assert len(encoded["target"]) > 2 * 32  # prefilled in 3 or more chunks of the step budget
    return encoded


@pytest.fixture(scope="module")
def expected(variant: TinyCheckpoint, prompts: dict[str, list[int]]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and logprobs for the target prompt."""
    torch.set_num_threads(1)
    tokens, logprobs = hf_greedy(variant.model, prompts["target"], NUM_NEW_TOKENS)
    assert len(set(tokens)) > 2, "degenerate model: the same few tokens"
    return tokens, logprobs


def assert_matches_transformers(result: Completion, expected: tuple[list[int], list[float]]) -> None:
    tokens, logprobs = expected
    assert result.token_ids == tokens
    ours = [entry.logprob for entry in result.logprobs]
    assert len(ours) == len(logprobs)
    worst = max(abs(a - b) for a, b in zip(ours, logprobs, strict=True))
    assert worst < LOGPROB_TOLERANCE, f"logprobs differ by {worst:.2e}"


def test_greedy_tokens_and_logprobs_equal_transformers_with_chunked_prefill(
        engine: LLMEngine, prompts: dict[str, list[int]], expected: tuple[list[int], list[float]]) -> None:
    result = generate(engine, {"target": prompts["target"]}, GREEDY)["target"]
    assert_matches_transformers(result, expected)
    assert_idle_and_clean(engine)
    from engine.kernels import cpu as native
    if native.load() and not engine.model_config.is_moe:  # decode rows took the native float step
        assert engine.runner._native_decode is not None


def test_same_tokens_among_8_concurrent_requests_and_after_a_prefix_cache_hit(
        engine: LLMEngine, prompts: dict[str, list[int]], expected: tuple[list[int], list[float]]) -> None:
    together = generate(engine, prompts, GREEDY)  # the target plus 7 others, one batch
    assert len(together) == 8
    assert_matches_transformers(together["target"], expected)
    again = generate(engine, {"target": prompts["target"]}, GREEDY)["target"]
    assert again.num_cached_tokens >= 16  # at least one whole block came from the prefix cache
    assert_matches_transformers(again, expected)
    assert_idle_and_clean(engine)


def test_outputs_under_preemption_equal_the_roomy_engines(
        engine: LLMEngine, make_engine: EngineFactory, prompts: dict[str, list[int]],
        expected: tuple[list[int], list[float]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = generate(engine, prompts, params)
    total_blocks = sum(-(-(len(p) + 24) // 16) for p in prompts.values())
    bytes_per_block = engine.runner.bytes_per_block
    tight = make_engine(kv_cache_memory_bytes=(total_blocks // 2) * bytes_per_block)
    assert tight.kv_cache.num_blocks == total_blocks // 2
    results = drive_with_checks(tight, prompts, params)
    assert tight.stats().num_preemptions_total > 0
    for name in prompts:
        assert results[name].token_ids == roomy[name].token_ids, name
    assert results["target"].token_ids[:NUM_NEW_TOKENS] == expected[0]
    assert_idle_and_clean(tight)


def drive_with_checks(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams
                      ) -> dict[str, Completion]:
    """`generate`, checking the KV allocator's invariant before every step."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    return drive(engine, on_step=lambda _: engine.kv_cache.check_integrity())
