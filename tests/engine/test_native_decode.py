"""The q4 mode with the native CPU kernels on the real model: every linear runs the GGUF's own
blocks with 8-bit activations (an approximation of the float model, like llama.cpp), and decode rows
take the native decode step; the float32 mode's decode rows take the native attention
(FloatDecodeStep). Skipped where the native kernels cannot be built."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from contracts.sampling_params import SamplingParams
from engine.batch import ScheduledBatch, ScheduledSequence
from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.kernels import cpu as native
from engine.model_runner import ModelRunner
from tests.engine.fakes import assert_idle_and_clean, drive, generate

pytestmark = pytest.mark.skipif(not native.load(), reason="native CPU kernels unavailable here")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TOPICS = ["the moon", "bread", "volcanoes", "jazz", "chess", "rain", "bees", "glass", "maps", "tea",
          "owls", "bridges"]


def build(model_path: str, checkpoint: Any, tokenizer: Any, decode_weights: str) -> LLMEngine:
    config = EngineConfig(model_path=model_path, num_threads=1, dtype="float32",
                          decode_weights=decode_weights,
                          cache=CacheConfig(kv_cache_memory_bytes=64 << 20,
                                            enable_prefix_caching=False))
    runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))
    return LLMEngine(config, checkpoint.config, runner, tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> dict[str, list[int]]:
    return {t: tokenizer.encode_chat([{"role": "user", "content": f"Tell me one fact about {t}."}])
            for t in TOPICS}


@pytest.fixture(scope="module")
def float_tokens(model_path: str, checkpoint: Any, tokenizer: Any,
                 prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    engine = build(model_path, checkpoint, tokenizer, "float")
    return {name: c.token_ids for name, c in generate(engine, prompts, GREEDY).items()}


@pytest.fixture(scope="module")
def q4_engine(model_path: str, checkpoint: Any, tokenizer: Any) -> LLMEngine:
    engine = build(model_path, checkpoint, tokenizer, "q4")
    assert engine.runner._native_decode is not None  # the q4 mode takes the native step here
    return engine


def test_greedy_output_is_identical_alone_and_among_concurrent_requests(
        q4_engine: LLMEngine, prompts: dict[str, list[int]]) -> None:
    """Decode rows always take the native step and every kernel computes rows independently, so
    neither the batch size nor prefill chunks sharing a step change a sequence's tokens."""
    target = "the moon"
    alone = generate(q4_engine, {target: prompts[target]}, GREEDY)[target].token_ids
    others = [name for name in TOPICS if name != target]

    def arrivals(step: int) -> None:  # half arrive with the target, the rest while it decodes
        if step == 0:
            q4_engine.add_request(target, prompts[target], GREEDY)
            for name in others[:5]:
                q4_engine.add_request(name, prompts[name], GREEDY)
        elif step in range(3, 3 + len(others) - 5):
            name = others[5 + step - 3]
            q4_engine.add_request(name, prompts[name], GREEDY)

    batched = drive(q4_engine, on_step=arrivals)
    assert len(batched) == len(TOPICS)
    assert batched[target].token_ids == alone
    assert_idle_and_clean(q4_engine)


def test_single_sequence_decode_with_4_bit_weights_starts_like_the_float_engine(
        q4_engine: LLMEngine, prompts: dict[str, list[int]],
        float_tokens: dict[str, list[int]]) -> None:
    for name in TOPICS[:4]:
        alone = generate(q4_engine, {name: prompts[name]}, GREEDY)[name].token_ids
        assert len(alone) == GREEDY.max_tokens
        # 8-bit activations: drift comes later, if at all
        assert alone[:4] == float_tokens[name][:4]


def test_quantized_decode_logits_stay_close_to_the_float_models(
        q4_engine: LLMEngine, model_path: str, checkpoint: Any, tokenizer: Any,
        prompts: dict[str, list[int]]) -> None:
    """One decode step of 3 rows: native (4-bit weights, 8-bit activations) vs the float runner."""
    float_runner = build(model_path, checkpoint, tokenizer, "float").runner
    logits = [decode_step_logits(runner, [prompts[n] for n in TOPICS[:3]])
              for runner in (q4_engine.runner, float_runner)]
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
    assert float((logits[0] - logits[1]).norm() / logits[1].norm()) < 0.05


def decode_step_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill all but each prompt's last token, then one decode step of every last token."""
    decodes = []
    for i, prompt in enumerate(prompts):
        num_blocks = -(-len(prompt) // runner.block_size)
        blocks = list(range(1 + 8 * i, 1 + 8 * i + num_blocks))
        runner.execute(ScheduledBatch([ScheduledSequence(f"p{i}", prompt[:-1], 0, blocks, False)]))
        decodes.append(ScheduledSequence(f"p{i}", prompt[-1:], len(prompt) - 1, blocks, True))
    return runner.execute(ScheduledBatch(decodes)).logits


def test_float_mode_decode_step_reproduces_the_general_forward(
        model_path: str, checkpoint: Any, tokenizer: Any, prompts: dict[str, list[int]],
        float_tokens: dict[str, list[int]]) -> None:
    """The float32 mode's decode rows take FloatDecodeStep (native attention over float32 K/V, the
    same norms and GEMMs); switched off, the general forward must produce the same greedy tokens."""
    engine = build(model_path, checkpoint, tokenizer, "float")
    assert engine.runner._native_decode.name == "FloatDecodeStep"
    engine.runner._native_decode = None  # the general forward: SDPA over gathered float32 K/V
    general = generate(engine, prompts, GREEDY)
    assert {name: c.token_ids for name, c in general.items()} == float_tokens


def test_q4_prefill_logits_do_not_depend_on_how_the_prompt_is_chunked(
        q4_engine: LLMEngine, prompts: dict[str, list[int]]) -> None:
    """Prefill chunks take the native step a row per token, each row alone: one chunk or two, and
    alone or beside another sequence's chunk, the last position's logits are the same bits."""
    runner = q4_engine.runner
    prompt, other = prompts["the moon"], prompts["bread"]
    blocks = list(range(100, 100 + -(-len(prompt) // runner.block_size)))
    other_blocks = list(range(130, 130 + -(-len(other) // runner.block_size)))
    whole = runner.execute(ScheduledBatch([ScheduledSequence("w", prompt, 0, blocks, True)])).logits
    split = 13
    runner.execute(ScheduledBatch([ScheduledSequence("c", prompt[:split], 0, blocks, False)]))
    chunked = runner.execute(ScheduledBatch([ScheduledSequence("o", other, 0, other_blocks, True),
                                             ScheduledSequence("c", prompt[split:], split, blocks,
                                                               True)]))
    assert chunked.request_ids == ["o", "c"]
    assert torch.equal(chunked.logits[1], whole[0])
