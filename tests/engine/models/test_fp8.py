"""--quantization fp8: linear weights kept in float8_e4m3fn with per-channel scales, dequantized per
call on the CPU; a tiny MoE model still predicts nearly the same next-token distributions."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.kernels.fp8 import FP8_DTYPE, quantize_weight_per_channel
from engine.layers.fp8_linear import FP8Linear
from engine.layers.linear import DenseLinear, OneDNNLinear
from engine.loader import load_checkpoint
from tests.engine.models._checkpoints import write_checkpoint
from tests.engine.models._greedy import greedy, make_runner

PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 8], [1, 2, 3, 4]]


def test_fp8_linear_stores_one_byte_per_weight_and_approximates_the_dense_product() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)  # [N, K]
    x = torch.randn(5, 64, generator=gen)  # [T, K]
    linear = FP8Linear.from_dense(weight, torch.float32)
    assert linear.wq.dtype == FP8_DTYPE and linear.wq.shape == (96, 64)
    assert linear.nbytes == 96 * 64 + 96 * 4
    out = linear(x)
    expected = x @ weight.T
    assert out.dtype == torch.float32 and out.shape == (5, 96)
    assert float((out - expected).norm() / expected.norm()) < 0.05
    torch.testing.assert_close(out, x @ linear.dequantize().T, rtol=1e-5, atol=1e-5)


def test_fp8_rows_are_scaled_independently() -> None:
    weight = torch.tensor([[1e-3, -2e-3, 5e-4], [300.0, -100.0, 50.0]])  # very different row ranges
    linear = FP8Linear.from_dense(weight, torch.float32)
    torch.testing.assert_close(linear.dequantize(), weight, rtol=0.07, atol=0.0)


def mean_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over rows of KL(reference || other) of the softmax distributions [rows, vocab]."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    other = torch.log_softmax(logits.double(), dim=-1)
    return float((ref.exp() * (ref - other)).sum(-1).mean())


def fake_quantized(weights: dict[str, torch.Tensor], biased_qkv: bool) -> dict[str, torch.Tensor]:
    """The float32 weights the FP8 engine computes with: every projection rounded through FP8 per
    output row (routers, shared-expert gate, embeddings, norms and lm_head untouched; LlamaModel
    keeps q/k/v dense when they carry biases, as Qwen2's do)."""
    out = dict(weights)
    dense_qkv = {f"self_attn.{n}_proj.weight" for n in "qkv"} if biased_qkv else set()
    for name, w in weights.items():
        if (name.endswith("proj.weight") and w.dim() == 2
            and name.split(".", 3)[-1] not in dense_qkv):
            wq, scale = quantize_weight_per_channel(w)
            out[name] = wq.float() * scale[:, None]
    return out


def test_fp8_moe_model_computes_with_its_fp8_rounded_weights(tmp_path: Path) -> None:
    write_checkpoint("qwen2_moe-shared", tmp_path)
    checkpoint = load_checkpoint(str(tmp_path), dtype=torch.float32, progress=False)
    dense = make_runner(checkpoint.config, checkpoint.weights)
    fp8 = make_runner(checkpoint.config, checkpoint.weights, quantization="fp8")
    rounded = make_runner(checkpoint.config,
                          fake_quantized(checkpoint.weights, checkpoint.config.attention_bias))

    layer = fp8.model.layers[0]
    assert isinstance(layer.o_proj, FP8Linear) and isinstance(layer.mlp.shared.gate_up, FP8Linear)
    assert layer.mlp.experts.w13.dtype == FP8_DTYPE and layer.mlp.experts.w2.dtype == FP8_DTYPE
    kept = (DenseLinear, OneDNNLinear)  # not FP8: the float forms the factory builds on this device
    assert isinstance(fp8.model.lm_head, kept) and isinstance(layer.mlp.router, kept)
    assert layer.mlp.experts.nbytes < dense.model.layers[0].mlp.experts.nbytes / 3

    tokens, fp8_logits = greedy(fp8, PROMPTS, 8)
    _, rounded_logits = greedy(rounded, PROMPTS, 8, forced=tokens)
    for a, b in zip(fp8_logits, rounded_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_fp8_moe_model_stays_close_to_float32(tmp_path: Path) -> None:
    """Mean KL(float32 || fp8) of the next-token distributions is a few percent of
    KL(float32 || uniform)."""
    write_checkpoint("mixtral", tmp_path, initializer_range=0.1)
    checkpoint = load_checkpoint(str(tmp_path), dtype=torch.float32, progress=False)
    dense = make_runner(checkpoint.config, checkpoint.weights)
    fp8 = make_runner(checkpoint.config, checkpoint.weights, quantization="fp8")
    tokens, dense_logits = greedy(dense, PROMPTS, 12)
    _, fp8_logits = greedy(fp8, PROMPTS, 12, forced=tokens)  # same contexts as float32
    for d, f in zip(dense_logits, fp8_logits, strict=True):
        kl_fp8, kl_uniform = mean_kl(d, f), mean_kl(d, torch.zeros_like(d))
        assert 0.0 < kl_fp8 < 0.05 * kl_uniform, (kl_fp8, kl_uniform)
