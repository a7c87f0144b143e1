"""Greedy decoding on the default model gives Hugging Face transformers' tokens, and the same
logits.

transformers reads the very same GGUF file (`gguf_file=`), dequantizes it itself and runs its own
Llama code, so this checks our loader, model, paged attention, chunked prefill and sampler against
an independent implementation. Ours runs all prompts concurrently in one engine whose step budget
(256 tokens) forces the long prompt to prefill in several chunks, beside the other requests'
decodes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from contracts.sampling_params import SamplingParams
from engine.batch import ScheduledBatch, ScheduledSequence
from engine.engine import LLMEngine
from engine.request import Request
from tests.engine.fakes import generate

NUM_NEW_TOKENS = 32
STEP_BUDGET = 256

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}


def _long_document() -> str:
    cities = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Perth", "Quebec", "Tbilisi", "Accra",
              "Cusco"]
    lines = [f"Day {i + 1}: the caravan left {cities[i % 10]} at {6 + i % 5} am, carried "
             f"{3 * i + 7} crates of {['tea', 'salt', 'copper', 'wool', 'glass'][i % 5]} and "
             "camped near a river."
             for i in range(40)]
    return "Here is a travel log.\n" + "\n".join(lines) + "\nSummarise the log in two sentences."


CHATS: dict[str, tuple[list[dict[str, str]], list[dict[str, Any]] | None]] = {
    "capital": ([{"role": "user", "content": "What is the capital of France?"}], None),
    "system_multi_turn": ([
        {"role": "system", "content": "You are a terse pirate. Answer in one line."},
        {"role": "user", "content": "How many legs does a spider have?"},
        {"role": "assistant", "content": "Eight, matey."},
        {"role": "user", "content": "And an ant?"}], None),
    "code": ([{"role": "user",
               "content": "Write a Python function that checks whether a number is prime."}],
             None),
    "tools": ([{"role": "user", "content": "What's the weather like in Paris today?"}],
              [WEATHER_TOOL]),
    "long_document": ([{"role": "user", "content": _long_document()}], None),
}


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> dict[str, list[int]]:
    encoded = {name: tokenizer.encode_chat(messages, tools=tools)
               for name, (messages, tools) in CHATS.items()}
    assert len(encoded["long_document"]) > 1000
    assert len(encoded["long_document"]) > 3 * STEP_BUDGET  # prefilled in several chunks
    return encoded


@pytest.fixture(scope="module")
def hf_greedy(hf_model: Any,
              prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], torch.Tensor]]:
    """transformers' greedy continuation (eos not stopping it) and its first-step logits, per
    prompt."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0)
    # generate() fills unset fields from the model's own generation config: unset eos there too, so
    # that eos does not stop it (our side: ignore_eos).
    saved_eos = hf_model.generation_config.eos_token_id
    hf_model.generation_config.eos_token_id = None
    results = {}
    try:
        with torch.inference_mode():
            for name, prompt in prompts.items():
                ids = torch.tensor([prompt])
                out = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                        generation_config=config,
                                        output_logits=True, return_dict_in_generate=True)
                results[name] = (out.sequences[0, len(prompt):].tolist(), out.logits[0][0].float())
    finally:
        hf_model.generation_config.eos_token_id = saved_eos
    return results


@pytest.fixture(scope="module")
def ours(make_engine: Any, prompts: dict[str, list[int]]) -> dict[str, Any]:
    engine = make_engine(max_num_batched_tokens=STEP_BUDGET)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            logprobs=True, top_logprobs=5)
    return generate(engine, prompts, params)


def last_position_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """One hand-built prefill step through the runner: the logits after the prompt's last token."""
    probe = Request("logits-probe", list(prompt), SamplingParams(max_tokens=1), (),
                    engine.max_model_len)
    # no hashes: nothing gets cached
    block_tables = engine.kv_cache.allocate_slots(probe, len(prompt))
    assert block_tables is not None
    block_table = block_tables[0]
    try:
        batch = ScheduledBatch([ScheduledSequence(probe.request_id, list(prompt), 0, block_table,
                                                  True)])
        step = engine.runner.execute(batch)
    finally:
        engine.kv_cache.free(probe)
    assert step.request_ids == [probe.request_id]
    return step.logits[0].float()


@pytest.mark.parametrize("name", list(CHATS))
def test_greedy_tokens_match_transformers(name: str, ours: dict[str, Any],
                                          hf_greedy: dict[str,
                                                          tuple[list[int], torch.Tensor]]) -> None:
    expected, _ = hf_greedy[name]
    assert len(expected) == NUM_NEW_TOKENS
    assert ours[name].token_ids == expected


# The long prompt's logits are compared through the engine's own chunked path below (a one-shot
# 1,100-token probe costs ~25 s on one thread, in the CPU attention's math fallback).
@pytest.mark.parametrize("name", [name for name in CHATS if name != "long_document"])
def test_last_position_logits_match_transformers(
        name: str, engine: LLMEngine, prompts: dict[str, list[int]],
        hf_greedy: dict[str, tuple[list[int], torch.Tensor]]) -> None:
    _, expected = hf_greedy[name]
    logits = last_position_logits(engine, prompts[name])
    relative_error = (torch.linalg.vector_norm(logits - expected)
                      / torch.linalg.vector_norm(expected)).item()
    assert relative_error < 1e-4
    assert torch.allclose(logits, expected, rtol=0, atol=1e-3 * expected.abs().max().item())


@pytest.mark.parametrize("name", list(CHATS))
def test_engine_logprobs_match_transformers_log_softmax(
        name: str, ours: dict[str, Any],
        hf_greedy: dict[str, tuple[list[int], torch.Tensor]]) -> None:
    """The engine path itself (chunked prefill, mixed batches) reports transformers'
    log-probabilities."""
    _, logits = hf_greedy[name]
    expected = torch.log_softmax(logits, dim=-1)
    first = ours[name].logprobs[0]
    assert first.token_id == int(expected.argmax())
    assert first.logprob == pytest.approx(expected[first.token_id].item(), abs=1e-4)
    top_ids = [token_id for token_id, _ in first.top]
    assert top_ids == expected.topk(5).indices.tolist()
    for token_id, logprob in first.top:
        assert logprob == pytest.approx(expected[token_id].item(), abs=1e-4)


def test_tools_reach_the_prompt(prompts: dict[str, list[int]], tokenizer: Any) -> None:
    text = tokenizer.decode(prompts["tools"])
    assert "get_weather" in text and "celsius" in text
