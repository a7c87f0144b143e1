"""The q4 mode's bf16 prefill (engine/models/llama_prefill.py, engine/layers/bf16_linear.py), forced
on whatever CPU runs the tests: on one without AMX / AVX512-BF16 PyTorch computes the same bf16
GEMMs without BF16 hardware (slow, correct), so the path is checked everywhere.

Tolerances: bf16 keeps 8 significant bits, so rounding an operand moves it by at most 2^-9 of
itself. A bf16 GEMM rounds x and W (the dequantized weight; the blocks' own values are exact in
float32) and its float32-accumulated result once: each of the three adds up to 2^-9 relative,
~2^-8 together for sums of many terms whose errors partly cancel, so one linear is held within
2^-7 (0.8%) of the float32 product of the same weights. A whole prefill through 30 layers is held
to what the integer path achieves and better: its logits must be closer to the float32 model's
than the 8-bit-activation path's are (and within 3%: measured 1.4%)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from engine.batch import ScheduledBatch, ScheduledSequence
from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.kernels import cpu as native
from engine.kernels.cpu import isa
from engine.layers.bf16_linear import Bf16Scratch, bf16_linear
from engine.layers.native_linear import NativeQuantLinear, to_native_blocks
from engine.model_runner import ModelRunner
from tests.engine.fakes import assert_idle_and_clean, generate
from tests.engine.test_cpu_isa import GREEDY, PROMPTS

pytestmark = pytest.mark.skipif(not native.load(), reason="native CPU kernels unavailable here")


def quantized(ggml_type: str, out_features: int, in_features: int, seed: int = 0
              ) -> tuple[torch.Tensor, NativeQuantLinear]:
    """(the weight as the file stores it, dequantized to float32; the kernels' form of it)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.1
    qtype = getattr(gguf.GGMLQuantizationType, ggml_type)
    raw = gguf.quants.quantize(weight, qtype)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(out_features,
                                                                        in_features).copy())
    return dense, NativeQuantLinear(*to_native_blocks(ggml_type, raw))


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_dequantized_tiles_are_the_file_weights_rounded_to_bf16(ggml_type: str) -> None:
    dense, linear = quantized(ggml_type, 96, 160)
    whole = torch.empty(96, 160, dtype=torch.bfloat16)
    torch.ops.aigw_cpu.dequantize_bf16(linear.blocks, linear.weight_type, 0, 12, whole)
    assert torch.equal(whole, dense.to(torch.bfloat16))  # q * d (+ m) is exact in float32
    part = torch.empty(24, 160, dtype=torch.bfloat16)  # column groups 5..7 alone
    torch.ops.aigw_cpu.dequantize_bf16(linear.blocks, linear.weight_type, 5, 8, part)
    assert torch.equal(part, whole[40:64])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.aigw_cpu.dequantize_bf16(linear.blocks, linear.weight_type, 8, 13, part)


# one tile; 5 tiles, the last short
@pytest.mark.parametrize("scratch_bytes", [1 << 20, 40 * 160 * 2])
def test_bf16_linear_is_within_bf16_rounding_of_the_float_product(scratch_bytes: int) -> None:
    dense, linear = quantized("Q4_1", 136, 160, seed=1)
    scratch = Bf16Scratch(scratch_bytes)
    x = torch.randn(37, 160, generator=torch.Generator().manual_seed(2))  # 37 rows: padded to 40
    out = bf16_linear(x.to(torch.bfloat16), linear, scratch)
    assert out.shape == (37, 136) and out.dtype == torch.bfloat16
    expected = x @ dense.T
    assert float((out.float() - expected).norm() / expected.norm()) < 2 ** -7
    assert scratch.nbytes <= max(scratch_bytes, 8 * 160 * 2)


def test_a_scratch_too_small_for_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 512 bytes"):
        Bf16Scratch(100)


@pytest.fixture(scope="module")
def runners(model_path: str, checkpoint: Any) -> Iterator[dict[str, ModelRunner]]:
    """The float32 model (--exact), the q4 mode with integer prefill, and the q4 mode with bf16
    prefill forced (amx_bf16 here whatever the CPU: the GEMMs dispatch on what it has)."""
    def build(decode_weights: str) -> ModelRunner:
        config = EngineConfig(model_path=model_path, num_threads=1, decode_weights=decode_weights,
                              cache=CacheConfig(kv_cache_memory_bytes=32 << 20,
                                                enable_prefix_caching=False))
        return ModelRunner(config, checkpoint.config, dict(checkpoint.weights),
                           dict(checkpoint.raw))

    chosen = isa.selection()
    built = {"float": build("float")}
    with pytest.MonkeyPatch.context() as patch:  # the runner reads the choice once, when built
        patch.setattr(isa, "selection", lambda: dataclasses.replace(chosen, prefill=None))
        built["integer"] = build("q4")
        patch.setattr(isa, "selection", lambda: dataclasses.replace(chosen, prefill="amx_bf16"))
        built["bf16"] = build("q4")
    yield built


def test_the_bf16_prefill_isa_is_in_the_runners_metadata(runners: dict[str, ModelRunner]) -> None:
    assert runners["bf16"].compute_info["cpu_prefill_isa"] == "amx_bf16"
    assert runners["integer"].compute_info["cpu_prefill_isa"] is None
    assert runners["float"].compute_info["cpu_prefill_isa"] is None


def _prompt_logits(runner: ModelRunner, tokens: list[int], split: int | None = None,
                   beside: list[int] | None = None) -> torch.Tensor:
    """Logits of every prompt row [len(tokens), vocab]: in one chunk, or in two split at `split`
    (the second attends to the first's cached K/V). `beside`: another prompt prefilled in the
    first chunk's step, whose first decode row then shares the second chunk's step."""
    bs = runner.block_size
    table = list(range(1, 1 + -(-len(tokens) // bs)))
    other_table = [len(table) + 1 + b for b in range(-(-(len(beside or []) + 1) // bs))]
    chunks = [(0, len(tokens))] if split is None else [(0, split), (split, len(tokens))]
    rows = []
    for start, end in chunks:
        seqs = [ScheduledSequence("p", tokens[start:end], start, table, end == len(tokens),
                                  needs_prompt_logits=True)]
        if beside is not None:  # its prompt, then its first decode row (a mixed step)
            other = ScheduledSequence("o", beside, 0, other_table, True) if start == 0 else \
                ScheduledSequence("o", [beside[-1]], len(beside), other_table, True)
            seqs.insert(0, other)
        done = runner.execute(ScheduledBatch(seqs))
        assert set(done.request_ids) == ({"o", "p"} if beside is not None and start > 0 else
                                         {"o"} if beside is not None else {"p"}
                                         if end == len(tokens) else set())
        rows.append(done.prompt_logits["p"])
    return torch.cat(rows)


def test_bf16_prefill_logits_are_closer_to_the_float_model_than_the_integer_paths_and_batch_free(
        runners: dict[str, ModelRunner], tokenizer: Any) -> None:
    """Logits of the 37 prompt rows in two chunks (the first beside another prompt, the second
    beside that one's decode row): ~3x closer to float32's than the integer path's, and the same
    bits as in one chunk alone (each GEMM runs in fixed 64-row tiles; attention is the native
    kernel's, row by row)."""
    tokens = tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    beside = tokenizer.encode_chat([{"role": "user", "content": "Hi."}])
    exact = _prompt_logits(runners["float"], tokens, 20)
    bf16 = _prompt_logits(runners["bf16"], tokens, 20, beside)
    integer = _prompt_logits(runners["integer"], tokens, 20)
    assert torch.equal(_prompt_logits(runners["bf16"], tokens), bf16)

    # relative to the float model's, over every prompt row
    def error(logits: torch.Tensor) -> float:
        return float((logits - exact).norm() / exact.norm())

    # here: 0.014, 0.044
    assert error(bf16) < error(integer) and error(bf16) < 0.03, (error(bf16), error(integer))


def _tokens(runner: ModelRunner, tokenizer: Any) -> list[list[int]]:
    engine = LLMEngine(runner.config, runner.model_config, runner, tokenizer)
    prompts = {str(i): tokenizer.encode_chat([{"role": "user", "content": p}])
               for i, p in enumerate(PROMPTS)}
    tokens = [c.token_ids for _, c in sorted(generate(engine, prompts, GREEDY).items())]
    assert_idle_and_clean(engine)
    return tokens


def _leading_agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_bf16_prefill_greedy_tokens_follow_the_float_model_at_least_as_far_as_the_integer_paths(
        runners: dict[str, ModelRunner], tokenizer: Any) -> None:
    """Decode rows are the integer kernels' in both q4 runs; only the prompt's K/V and first token
    differ. Measured here: bf16 prefill gives the float model's 12 tokens on both prompts; integer
    prefill the same on the haiku prompt, and another first token on the capital-of-France one."""
    exact, bf16, integer = (_tokens(runners[name], tokenizer)
                            for name in ("float", "bf16", "integer"))
    assert all(len(t) == GREEDY.max_tokens for t in bf16 + integer)
    for e, b, i in zip(exact, bf16, integer, strict=True):
        assert b[0] == e[0]  # the token the prefill alone decides
        assert _leading_agreement(b, e) >= _leading_agreement(i, e)
