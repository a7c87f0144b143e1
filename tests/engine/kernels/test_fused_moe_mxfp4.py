"""The MXFP4 fused MoE (B read as e2m1 nibbles + e8m0 scales in the kernel) vs
dequantize-then-reference, in Triton's interpreter on CPU: gpt-oss's biases and clamped SwiGLU, and
the plain SiLU experts."""

import pytest
import torch

from engine.kernels.activation import ClampedSwiGLU
from engine.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_reference, fused_moe_mxfp4_triton
from engine.layers.mxfp4 import quantize_mxfp4
from tests.engine.kernels._util import DEVICE, DTYPES, assert_close


def make_mxfp4_moe(num_tokens, num_experts, hidden, inter, dtype, top_k):
    h = (torch.randn(num_tokens, hidden) * 2).to(DEVICE, dtype)
    w13 = quantize_mxfp4(torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5 * 4)
    w2 = quantize_mxfp4(torch.randn(num_experts, hidden, inter) / inter**0.5)
    biases = (torch.randn(num_experts, 2 * inter).to(DEVICE, dtype),
              torch.randn(num_experts, hidden).to(DEVICE, dtype))
    top, ids = torch.topk(torch.randn(num_tokens, num_experts), top_k, dim=-1)
    weights = torch.softmax(top, dim=-1).to(DEVICE)
    experts = [t.to(DEVICE) for t in (*w13, *w2)]  # w13 blocks, scales, w2 blocks, scales
    return h, experts, biases, weights, ids.to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "top_k", "hidden", "inter"),
                         [(9, 4, 96, 64)])
def test_mxfp4_triton_matches_dequantized_reference_for_gpt_oss_experts(
        num_tokens, top_k, hidden, inter, dtype):
    h, experts, (b13, b2), weights, ids = make_mxfp4_moe(num_tokens, 4, hidden, inter, dtype, top_k)
    extra = {"w13_bias": b13, "w2_bias": b2, "activation": ClampedSwiGLU()}
    out = fused_moe_mxfp4_triton(h, *experts, weights, ids, **extra)
    expected = fused_moe_mxfp4_reference(h, *experts, weights, ids, **extra)
    assert expected.abs().max() > 1.0  # not a near-zero output that any kernel would match
    assert_close(out, expected, dtype)


def test_mxfp4_triton_matches_dequantized_reference_for_silu_experts_without_biases():
    h, experts, _, weights, ids = make_mxfp4_moe(5, 4, 64, 32, torch.float32, 2)
    out = fused_moe_mxfp4_triton(h, *experts, weights, ids)
    assert_close(out, fused_moe_mxfp4_reference(h, *experts, weights, ids), torch.float32)


def test_gpt_oss_moe_layer_runs_mxfp4_experts_through_the_kernel_as_the_cpu_path_computes(
        monkeypatch):
    """engine/models/gpt_oss_moe.py: on the Triton backend the MXFP4 experts go to the kernel as
    stored (interleaved gate/up rows split at load), on the torch one the routed experts are
    dequantized."""
    from engine.config import ModelConfig
    from engine.models import gpt_oss_moe as moe_module

    config = ModelConfig(architecture="gpt_oss", vocab_size=8, hidden_size=64, intermediate_size=32,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                         max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, layer_types=("full_attention",))
    p = "model.layers.0.mlp."
    gate_up = quantize_mxfp4(torch.randn(4, 64, 64) / 2)  # [E, 2I, H], gate/up interleaved
    down = quantize_mxfp4(torch.randn(4, 64, 32) / 4)  # [E, H, I]
    weights = {p + "router.weight": torch.randn(4, 64), p + "router.bias": torch.randn(4),
               p + "experts.gate_up_proj_blocks": gate_up[0],
               p + "experts.gate_up_proj_scales": gate_up[1],
               p + "experts.down_proj_blocks": down[0], p + "experts.down_proj_scales": down[1],
               p + "experts.gate_up_proj_bias": torch.randn(4, 64),
               p + "experts.down_proj_bias": torch.randn(4, 64)}
    layer = moe_module.gpt_oss_moe(config, dict(weights), 0, torch.device(DEVICE), torch.float32,
                                   dequantize_mxfp4=False)
    assert layer.experts.is_mxfp4
    x = torch.randn(7, 64, device=DEVICE)
    monkeypatch.setattr("engine.kernels.FORCED_BACKEND", "torch")
    expected = layer(x)
    calls = []
    real_kernel = __import__("engine.kernels.fused_moe_mxfp4",
                             fromlist=["x"]).fused_moe_mxfp4_triton
    monkeypatch.setattr("engine.kernels.fused_moe_mxfp4.fused_moe_mxfp4_triton",
                        lambda *a, **k: calls.append(1) or real_kernel(*a, **k))
    monkeypatch.setattr("engine.kernels.FORCED_BACKEND", "triton")
    assert_close(layer(x), expected, torch.float32)
    assert calls == [1]
