"""Prompt logprobs (what `echo` + `logprobs` return): each prompt token's log probability under
the model, equal to transformers' own, whatever the chunking and the prefix cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from contracts.sampling_params import SamplingParams, SamplingParamsError
from engine.engine import LLMEngine
from engine.outputs import TokenLogprob
from tests.engine.conftest import EngineFactory

TEXT = ("The capital of France is Paris. The capital of Germany is Berlin. Rivers run to the sea, "
        "and the sea is salty because rivers carry minerals from the rocks they cross.")


def _prompt_logprobs(engine: LLMEngine, prompt: list[int], num_top: int = 2
                     ) -> tuple[list[TokenLogprob], int]:
    engine.add_request("scored", prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                        prompt_logprobs=num_top))
    found, num_cached = None, -1
    while engine.has_unfinished_requests:
        for output in engine.step():
            if output.prompt_logprobs is not None:
                found, num_cached = output.prompt_logprobs, output.num_cached_tokens
    assert found is not None
    return found, num_cached


def test_prompt_logprobs_equal_transformers_in_chunks(make_engine: EngineFactory, hf_model: Any
                                                      ) -> None:
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=4)  # 3 chunks or more
    prompt = engine.tokenizer.encode(TEXT)
    assert len(prompt) > 32
    found, _ = _prompt_logprobs(engine, prompt)
    assert [entry.token_id for entry in found] == prompt[1:]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()  # [P, vocab]
    expected = logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor([entry.logprob for entry in found])
    assert torch.allclose(got, expected, atol=1e-3), (got - expected).abs().max()
    best = logits.log_softmax(-1)[: len(prompt) - 1].topk(2, dim=-1)
    assert [[token for token, _ in entry.top] for entry in found] == best.indices.tolist()


def test_a_cached_prefix_is_recomputed_for_its_logprobs(make_engine: EngineFactory) -> None:
    engine = make_engine(fresh=True)
    prompt = engine.tokenizer.encode(TEXT)
    engine.add_request("warm", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests:
        engine.step()
    cached_run, num_cached = _prompt_logprobs(engine, prompt, num_top=0)
    assert num_cached == 0 and len(cached_run) == len(prompt) - 1  # every position computed
    cold = make_engine(fresh=True)
    cold_run, _ = _prompt_logprobs(cold, prompt, num_top=0)
    assert [e.logprob for e in cached_run] == [e.logprob for e in cold_run]
    engine.kv_cache.check_integrity()


def test_max_tokens_zero_only_scores_the_prompt(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(TEXT)
    engine.add_request("score", prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    outputs = []
    while engine.has_unfinished_requests:
        outputs += engine.step()
    (final,) = outputs
    assert (final.new_token_ids, final.text, str(final.finish_reason)) == ([], "", "length")
    assert final.num_output_tokens == 0 and len(final.prompt_logprobs or ()) == len(prompt) - 1
    assert engine.kv_cache.pool.num_used_blocks == 0
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_prompt_logprobs_survive_preemption_mid_prefill(make_engine: EngineFactory) -> None:
    """A tiny KV cache preempts requests while they compute their prompt in chunks: each
    prompt position is still scored once, equal to a cold run's, and no block leaks."""
    tight = make_engine(kv_cache_memory_bytes=6 << 20, max_num_batched_tokens=16, max_num_seqs=4,
                        fresh=True)
    prompts = {f"r{i}": tight.tokenizer.encode(f"{i}. {TEXT}")[:44] for i in range(3)}
    for request_id, prompt in prompts.items():
        tight.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                             ignore_eos=True, prompt_logprobs=0))
    found: dict[str, list[TokenLogprob]] = {}
    while tight.has_unfinished_requests:
        for output in tight.step():
            if output.prompt_logprobs is not None:
                found[output.request_id] = output.prompt_logprobs
    assert tight.scheduler.num_preemptions_total > 0
    assert tight.kv_cache.pool.num_used_blocks == 0
    cold = make_engine(fresh=True)
    for request_id, prompt in prompts.items():
        expected, _ = _prompt_logprobs(cold, prompt, num_top=0)
        assert [e.token_id for e in found[request_id]] == prompt[1:]
        got = torch.tensor([e.logprob for e in found[request_id]])
        assert torch.allclose(got, torch.tensor([e.logprob for e in expected]), atol=1e-4)


def test_an_answer_ended_by_eos_has_a_logprob_for_each_token_of_its_text(engine: LLMEngine) -> None:
    """The end-of-sequence token is counted in usage but is not part of the answer: it gets no
    logprob entry (as OpenAI's logprobs hold no end token), so the entries spell the text."""
    prompt = list(engine.tokenizer.encode_chat([{"role": "user", "content": "Say hi."}],
                                               add_generation_prompt=True))
    engine.add_request("eos", prompt, SamplingParams(temperature=0.0, max_tokens=64, logprobs=True))
    outputs = []
    while engine.has_unfinished_requests:
        outputs += engine.step()
    final = outputs[-1]
    assert str(final.finish_reason) == "stop" and final.stop_reason is None  # ended by EOS
    entries = [entry for output in outputs for entry in output.logprobs or ()]
    assert len(entries) == final.num_output_tokens - 1
    assert not {entry.token_id for entry in entries} & set(engine.model_config.eos_token_ids)
    assert (engine.tokenizer.decode([e.token_id for e in entries])
            == "".join(o.text for o in outputs))
