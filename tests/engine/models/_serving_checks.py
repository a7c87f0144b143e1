"""The engine-level checks every family's model test repeats: an engine over a tiny checkpoint,
greedy parity with transformers, the same tokens among 8 concurrent requests with chunked prefill,
after a prefix-cache hit, and a KV-checked drive for preemption runs.

Each `check_*` holds the assertions its callers used to spell out; a caller passes its own prompts,
reference outputs and engine, so what each family's test asserts is unchanged."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from tests.engine.fakes import Completion, assert_idle_and_clean, drive, generate
from tests.engine.models._greedy import hf_greedy

LOGPROB_TOLERANCE = 2e-3
EngineFactory = Callable[..., LLMEngine]


def make_engine(directory: Path, *, kv_cache_memory_bytes: int = 8 << 20,
                max_num_batched_tokens: int = 256, enable_prefix_caching: bool = True,
                max_num_seqs: int = 16) -> LLMEngine:
    """A float32, one-thread engine over the checkpoint in `directory`."""
    config = EngineConfig(
        model_path=str(directory), num_threads=1, dtype="float32",
        cache=CacheConfig(kv_cache_memory_bytes=kv_cache_memory_bytes,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs))
    return LLMEngine.from_config(config, progress=False)


def encode_chat_prompts(engine: LLMEngine, target: str, others: Sequence[str],
                        system: str | None = None) -> dict[str, list[int]]:
    """{"target": `target` as a user turn (after a `system` turn, if any), "other-{i}": each of
    `others` as a user turn}, encoded by the engine's chat template."""
    chat = engine.tokenizer.encode_chat
    first = [{"role": "system", "content": system}] if system is not None else []
    encoded = {"target": chat([*first, {"role": "user", "content": target}])}
    encoded |= {f"other-{i}": chat([{"role": "user", "content": text}])
                for i, text in enumerate(others)}
    return encoded


def transformers_reference(model: torch.nn.Module, prompt: list[int], num_new_tokens: int
                           ) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs for `prompt` (on one thread), refusing a
    degenerate model (the same few tokens) that would make parity say nothing."""
    torch.set_num_threads(1)
    tokens, logprobs = hf_greedy(model, prompt, num_new_tokens)
    assert len(set(tokens)) > 2, "degenerate model: the same few tokens"
    return tokens, logprobs


def assert_matches_transformers(result: Completion,
                                expected: tuple[list[int], list[float]]) -> None:
    tokens, logprobs = expected
    assert result.token_ids == tokens
    ours = [entry.logprob for entry in result.logprobs]
    assert len(ours) == len(logprobs)
    worst = max(abs(a - b) for a, b in zip(ours, logprobs, strict=True))
    assert worst < LOGPROB_TOLERANCE, f"logprobs differ by {worst:.2e}"


def drive_with_checks(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams
                      ) -> dict[str, Completion]:
    """`generate`, checking the KV allocator's invariant before every step."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    return drive(engine, on_step=lambda _: engine.kv_cache.check_integrity())


def check_greedy_parity(engine: LLMEngine, prompts: dict[str, list[int]],
                        reference: dict[str, tuple[list[int], list[float]]],
                        params: SamplingParams) -> None:
    """Every prompt, batched: transformers' greedy tokens, logprobs within LOGPROB_TOLERANCE."""
    out = generate(engine, prompts, params)
    for p in prompts:
        tokens, logprobs = reference[p]
        assert len(set(tokens)) > 2, "degenerate model: the same few tokens every step"
        assert out[p].token_ids == tokens, p
        ours = [lp.logprob for lp in out[p].logprobs]
        assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < LOGPROB_TOLERANCE, p
    assert_idle_and_clean(engine)


def check_target_among_8_concurrent(engine: LLMEngine, target: list[int],
                                    others: dict[str, list[int]],
                                    expected_tokens: list[int], params: SamplingParams) -> None:
    """`target` with 4 of the 8 `others` at step 0, the rest arriving at steps 3..6 (the engine's
    step budget splits the prefills): the target's tokens are `expected_tokens`."""
    def arrivals(step: int) -> None:
        if step == 0:
            for name, prompt in list(others.items())[:4]:
                engine.add_request(name, prompt, params)
            engine.add_request("target", target, params)
        elif step in range(3, 7):
            name = f"o{step + 1}"
            engine.add_request(name, others[name], params)

    batched = drive(engine, on_step=arrivals)
    assert len(batched) == 9
    assert batched["target"].token_ids == expected_tokens
    assert_idle_and_clean(engine)


def check_prefix_cache_hit(engine: LLMEngine, model: torch.nn.Module, prompt: list[int],
                           expected_tokens: list[int], params: SamplingParams) -> None:
    """The same prompt twice, then one sharing its first 35 tokens: at least two blocks of 16 come
    from the cache each time, and the tokens are transformers' (`model`'s) greedy ones."""
    first = generate(engine, {"first": prompt}, params)["first"]
    again = generate(engine, {"again": prompt}, params)["again"]
    assert again.num_cached_tokens >= 32  # two whole blocks of 16 came from the cache
    assert first.token_ids == again.token_ids == expected_tokens
    # a new prompt sharing the first 35 tokens: served from the cache up to a block boundary
    branch = prompt[:35] + [3, 1, 4, 1, 5, 9, 2, 6]
    hit = generate(engine, {"branch": branch}, params)["branch"]
    assert hit.num_cached_tokens >= 32
    assert hit.token_ids == hf_greedy(model, branch, params.max_tokens)[0]
    assert_idle_and_clean(engine)


def check_same_tokens_together_and_after_a_prefix_hit(
        engine: LLMEngine, prompts: dict[str, list[int]], expected: tuple[list[int], list[float]],
        params: SamplingParams) -> None:
    """The target plus 7 others in one batch, then the target again from the prefix cache."""
    together = generate(engine, prompts, params)
    assert len(together) == 8
    assert_matches_transformers(together["target"], expected)
    again = generate(engine, {"target": prompts["target"]}, params)["target"]
    assert again.num_cached_tokens >= 16  # at least one whole block came from the prefix cache
    assert_matches_transformers(again, expected)
    assert_idle_and_clean(engine)


def check_preemption_matches_roomy(engine: LLMEngine, make_engine: EngineFactory,
                                   prompts: dict[str, list[int]], expected_tokens: list[int],
                                   num_blocks: int) -> None:
    """All `prompts` (24 greedy tokens each) on an engine of `num_blocks` KV blocks, which must
    preempt: each gets the tokens `engine` (roomy) gives it, the target's first are
    `expected_tokens` (transformers'), the allocator's invariant holds every step and every block
    comes back."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = generate(engine, prompts, params)
    tight = make_engine(kv_cache_memory_bytes=num_blocks * engine.runner.bytes_per_block)
    assert tight.kv_cache.num_blocks == num_blocks
    assert tight.max_model_len >= max(map(len, prompts.values())) + 24  # one request fits alone
    results = drive_with_checks(tight, prompts, params)
    assert tight.stats().num_preemptions_total > 0
    for name in prompts:
        assert results[name].token_ids == roomy[name].token_ids, name
    assert results["target"].token_ids[: len(expected_tokens)] == expected_tokens
    assert_idle_and_clean(tight)
