"""gpt-oss experts in the fused MoE: biases and the clamped SwiGLU, reference vs a naive loop in
float64 (transformers' formula on the interleaved layout), Triton vs reference (interpreter on
CPU)."""

import pytest
import torch

from engine.kernels.activation import ClampedSwiGLU
from engine.kernels.fused_moe import fused_moe_reference, fused_moe_triton
from tests.engine.kernels._util import DEVICE, DTYPES, assert_close

ACT = ClampedSwiGLU(alpha=1.702, limit=7.0)


def make_gpt_oss_moe(num_tokens, num_experts, hidden, inter, dtype, top_k):
    # large enough that the clamp at 7 bites on some gate and up values
    h = torch.randn(num_tokens, hidden) * 3
    w13 = torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter) / inter**0.5
    b13, b2 = torch.randn(num_experts, 2 * inter), torch.randn(num_experts, hidden)
    logits = torch.randn(num_tokens, num_experts)
    top, ids = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    tensors = [t.to(DEVICE, dtype) for t in (h, w13, w2, b13, b2)]
    return (*tensors, weights.to(DEVICE), ids.to(torch.int32).to(DEVICE))


def naive_gpt_oss(h, w13, w2, b13, b2, weights, ids):
    """transformers' GptOssExperts math per token in float64, gate/up interleaved as in the file."""
    inter = w2.shape[2]
    interleaved = torch.stack([w13[:, :inter], w13[:, inter:]], dim=2).flatten(1, 2)  # [E, 2I, H]
    b_interleaved = torch.stack([b13[:, :inter], b13[:, inter:]], dim=2).flatten(1)  # [E, 2I]
    out = torch.zeros(h.shape, dtype=torch.float64)
    for t in range(h.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = interleaved[e].double() @ h[t].double() + b_interleaved[e].double()
            gate, up = gate_up[::2].clamp(max=ACT.limit), gate_up[1::2].clamp(-ACT.limit, ACT.limit)
            act = (up + 1) * gate * torch.sigmoid(gate * ACT.alpha)
            out[t] += float(weights[t, k]) * (w2[e].double() @ act + b2[e].double())
    return out


def test_reference_matches_transformers_formula_with_clamped_swiglu_and_biases():
    h, w13, w2, b13, b2, weights, ids = (t.cpu() for t in make_gpt_oss_moe(11, 4, 64, 32,
                                                                           torch.float32, 2))
    out = fused_moe_reference(h, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, activation=ACT)
    gate_up = h @ w13[0].T + b13[0]
    assert (gate_up.abs() > ACT.limit).any(), "inputs too small to exercise the clamp"
    torch.testing.assert_close(out.double(), naive_gpt_oss(h, w13, w2, b13, b2, weights, ids),
                               atol=1e-4, rtol=1e-4)
    plain = fused_moe_reference(h, w13, w2, weights, ids)
    assert not torch.allclose(plain, out, atol=1e-2), "the activation and biases changed nothing"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (13, 4)])
def test_triton_matches_reference_with_clamped_swiglu_and_biases(num_tokens, top_k, dtype):
    h, w13, w2, b13, b2, weights, ids = make_gpt_oss_moe(num_tokens, 4, 64, 32, dtype, top_k)
    extra = {"w13_bias": b13, "w2_bias": b2, "activation": ACT}
    out = fused_moe_triton(h, w13, w2, weights, ids, **extra)
    assert_close(out, fused_moe_reference(h, w13, w2, weights, ids, **extra), dtype)
