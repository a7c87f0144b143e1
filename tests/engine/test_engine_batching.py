"""Continuous batching on the real model: batch invariance, no leaks under aborts, preemption that
does not change outputs, and the sampling parameters' semantics end to end (one engine, many
requests)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from contracts.sampling_params import SamplingParams
from engine.engine import LLMEngine
from engine.outputs import FinishReason
from tests.engine.conftest import EngineFactory
from tests.engine.fakes import Completion, assert_idle_and_clean, collect, drive, generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TOPICS = ["the moon", "bread", "volcanoes", "jazz", "chess", "rain", "bees", "glass", "maps", "tea",
          "owls", "bridges", "salt", "comets", "paper", "wolves", "kites", "ice"]


def chat(tokenizer: Any, topic: str, repeat: int = 1) -> list[int]:
    content = f"Tell me one fact about {topic}. " + "Be brief and clear. " * repeat
    return tokenizer.encode_chat([{"role": "user", "content": content}])


@pytest.fixture(scope="module")
def no_cache_engine(make_engine: EngineFactory) -> LLMEngine:
    """Prefix caching off, so that a repeated request recomputes its whole prompt."""
    return make_engine(enable_prefix_caching=False, max_num_batched_tokens=256)


# ---- batch invariance ----------------------------------------------------------------------------
def test_greedy_output_is_identical_alone_and_among_16_concurrent_requests(
        no_cache_engine: LLMEngine, tokenizer: Any) -> None:
    target = chat(tokenizer, "lighthouses", repeat=3)
    alone = generate(no_cache_engine, {"target": target}, GREEDY)["target"]
    others = {f"other-{i}": chat(tokenizer, topic, repeat=i % 7)
              for i, topic in enumerate(TOPICS[:16])}
    lengths = {len(p) for p in others.values()}
    assert len(lengths) >= 5  # prompts of many lengths
    params = {name: SamplingParams(temperature=0.0, max_tokens=16 + i % 2 * 8, ignore_eos=True)
              for i, name in enumerate(others)}
    names = list(others)

    def arrivals(step: int) -> None:  # half arrive together with the target, the rest while it runs
        if step == 0:
            for name in names[:8]:
                no_cache_engine.add_request(name, others[name], params[name])
            no_cache_engine.add_request("target", target, GREEDY)
        elif step in range(2, 10):
            name = names[8 + step - 2]
            no_cache_engine.add_request(name, others[name], params[name])

    batched = drive(no_cache_engine, on_step=arrivals)
    assert batched["target"].token_ids == alone.token_ids
    assert len(batched) == 17
    assert_idle_and_clean(no_cache_engine)


# ---- no leaks ------------------------------------------------------------------------------------
def test_64_concurrent_requests_with_random_aborts_leave_every_block_free(
        make_engine: EngineFactory, tokenizer: Any) -> None:
    engine = make_engine(max_num_batched_tokens=256, fresh=True)
    rng = random.Random(1234)
    shared = chat(tokenizer, "rivers", repeat=4)
    prompts = {}
    for i in range(64):
        head = shared[: rng.randrange(len(shared))] if i % 2 else []
        prompts[f"r{i}"] = head + [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 30))]
    params = SamplingParams(temperature=0.7, seed=7, max_tokens=16, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    aborted: set[str] = set()
    results: dict[str, Completion] = {}

    def abort_some(step: int) -> None:
        for request_id in rng.sample(sorted(prompts), 3):
            if rng.random() < 0.5 and request_id not in aborted and request_id not in finished():
                output = engine.abort_request(request_id)
                assert output is not None and output.finish_reason == FinishReason.ABORT
                aborted.add(request_id)
        engine.kv_cache.check_integrity()

    def finished() -> set[str]:
        return {k for k, v in results.items() if v.finish_reason is not None}

    for step in range(2000):
        abort_some(step)
        if not engine.has_unfinished_requests:
            break
        for output in engine.step():
            collect(results, output)
    assert 10 < len(aborted) < 60  # both outcomes happened, at many different points
    assert finished() | aborted == set(prompts)
    assert all(len(results[r].token_ids) == 16 for r in set(prompts) - aborted)
    assert_idle_and_clean(engine)
    assert engine.abort_request("r0") is None  # aborting a finished request is a no-op


def test_aborting_a_request_frees_its_blocks_at_once(engine: LLMEngine, tokenizer: Any) -> None:
    engine.add_request("held", chat(tokenizer, "clouds", repeat=20), GREEDY)
    engine.step()
    assert engine.kv_cache.pool.num_used_blocks > 0
    engine.abort_request("held")
    assert_idle_and_clean(engine)


# ---- preemption ----------------------------------------------------------------------------------
def test_outputs_under_preemption_equal_outputs_with_a_large_budget(make_engine: EngineFactory,
                                                                    engine: LLMEngine,
                                                                    tokenizer: Any) -> None:
    prompts = {f"p{i}": chat(tokenizer, topic, repeat=i % 3) for i, topic in enumerate(TOPICS[:6])}
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    roomy = generate(engine, prompts, params)
    bytes_per_block = engine.runner.bytes_per_block
    # 6 requests of ~40-60 + 32 tokens need ~33 blocks together; 14 blocks hold about two of them.
    tight_engine = make_engine(kv_cache_memory_bytes=14 * bytes_per_block,
                               max_num_batched_tokens=128, fresh=True)
    assert tight_engine.kv_cache.num_blocks == 14
    tight = generate(tight_engine, prompts, params)
    assert tight_engine.stats().num_preemptions_total > 0
    for name in prompts:
        assert tight[name].token_ids == roomy[name].token_ids, name
        assert tight[name].finish_reason == FinishReason.LENGTH
    assert_idle_and_clean(tight_engine)


# ---- sampling semantics --------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_across_runs_and_batch_compositions(
        no_cache_engine: LLMEngine, tokenizer: Any) -> None:
    """(Without prefix caching: a cache hit computes the prompt's tail differently, equal only up to
    float rounding, which can move a seeded draw that falls near a boundary.)"""
    engine = no_cache_engine
    prompt = chat(tokenizer, "the sea")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=24, ignore_eos=True)
    alone = generate(engine, {"s": prompt}, seeded)["s"].token_ids
    crowd = {f"c{i}": chat(tokenizer, t) for i, t in enumerate(TOPICS[:6])}
    for request_id, other in crowd.items():
        engine.add_request(request_id, other, SamplingParams(temperature=1.0, max_tokens=20))
    engine.add_request("s", prompt, seeded)
    engine.add_request("other-seed", prompt, SamplingParams(temperature=1.0, top_p=0.95, seed=43,
                                                            max_tokens=24, ignore_eos=True))
    together = drive(engine)
    assert together["s"].token_ids == alone
    assert together["other-seed"].token_ids != alone
    assert_idle_and_clean(engine)


def test_max_tokens_ends_with_length_and_eos_ends_with_stop(engine: LLMEngine,
                                                            tokenizer: Any) -> None:
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    results = generate(engine, {"p": prompt}, SamplingParams(temperature=0.0, max_tokens=64))
    natural = results["p"]
    assert natural.finish_reason == FinishReason.STOP and natural.stop_reason is None
    assert natural.token_ids[-1] in engine.model_config.eos_token_ids
    assert len(natural.token_ids) < 64 and "<|im_end|>" not in natural.text
    capped = generate(engine, {"p": prompt}, SamplingParams(temperature=0.0, max_tokens=3))["p"]
    assert capped.finish_reason == FinishReason.LENGTH and capped.token_ids == natural.token_ids[:3]
    ignoring = generate(engine, {"p": prompt}, SamplingParams(temperature=0.0, max_tokens=20,
                                                               ignore_eos=True))["p"]
    assert ignoring.finish_reason == FinishReason.LENGTH and len(ignoring.token_ids) == 20
    assert ignoring.token_ids[: len(natural.token_ids)] == natural.token_ids
    at_least = generate(engine, {"p": prompt},
                        SamplingParams(temperature=0.0, max_tokens=40,
                                       min_tokens=len(natural.token_ids) + 5))["p"]
    eos = set(engine.model_config.eos_token_ids)
    assert len(at_least.token_ids) >= len(natural.token_ids) + 5
    assert not eos & set(at_least.token_ids[: len(natural.token_ids) + 4])


def test_stop_string_and_stop_token_end_the_output_and_are_not_included(engine: LLMEngine,
                                                                        tokenizer: Any) -> None:
    prompt = chat(tokenizer, "the desert", repeat=1)
    full = generate(engine, {"p": prompt}, GREEDY)["p"]
    words = full.text.split()
    assert len(words) > 4
    stop = " " + words[3]
    expected_text = full.text[: full.text.index(stop)]
    stopped = generate(engine, {"p": prompt}, SamplingParams(temperature=0.0, max_tokens=24,
                                                             ignore_eos=True,
                                                              stop=(stop,)))["p"]
    assert stopped.finish_reason == FinishReason.STOP and stopped.stop_reason == stop
    assert stopped.text == expected_text
    stop_token = full.token_ids[5]
    by_token = generate(engine, {"p": prompt}, SamplingParams(temperature=0.0, max_tokens=24,
                                                              ignore_eos=True,
                                                               stop_token_ids=(stop_token,)))["p"]
    first = full.token_ids.index(stop_token)
    assert by_token.finish_reason == FinishReason.STOP and by_token.stop_reason == stop_token
    assert by_token.token_ids == full.token_ids[: first + 1]
    # the stop token's text is left out
    assert by_token.text == tokenizer.decode(full.token_ids[:first])


def test_stop_string_does_not_end_the_output_before_min_tokens(engine: LLMEngine,
                                                               tokenizer: Any) -> None:
    prompt = chat(tokenizer, "the desert", repeat=1)
    full = generate(engine, {"p": prompt}, GREEDY)["p"]
    stop = " " + full.text.split()[1]  # appears within the first few tokens
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=(stop,),
                            min_tokens=12)
    result = generate(engine, {"p": prompt}, params)["p"]
    assert len(result.token_ids) >= 12
    assert result.token_ids == full.token_ids[: len(result.token_ids)]


def test_token_ids_outside_the_vocabulary_are_refused_and_the_engine_keeps_serving(
        engine: LLMEngine, tokenizer: Any) -> None:
    """A stop token id past the vocabulary under min_tokens (the sampler blocks stop ids by
    indexing the logits with them) failed the step with an IndexError: every request in it and
    the replica's engine loop with it. Refused when added now; the others are served."""
    from contracts.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParamsError

    vocab_size = engine.model_config.vocab_size
    prompt = chat(tokenizer, "owls")
    engine.add_request("running", prompt, GREEDY)
    for bad_prompt, bad_stop in (([vocab_size], ()), ([1, -1], ()), (prompt, (vocab_size,)),
                                 (prompt, (1 << 62,))):
        with pytest.raises(ValueError, match="token ids must be in"):
            engine.add_request("bad", bad_prompt, SamplingParams(
                max_tokens=4, min_tokens=2, stop_token_ids=bad_stop))
    for stop_ids in ((-1,), tuple(range(MAX_STOP_TOKEN_IDS + 1))):
        with pytest.raises(SamplingParamsError) as refused:
            SamplingParams(stop_token_ids=stop_ids)
        assert refused.value.param == "stop_token_ids"
    edge = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, ignore_eos=True,
                          stop_token_ids=(0, vocab_size - 1))
    done = generate(engine, {"edge": prompt}, edge)
    assert len(done["running"].token_ids) == GREEDY.max_tokens
    assert len(done["edge"].token_ids) >= 3
    assert_idle_and_clean(engine)
