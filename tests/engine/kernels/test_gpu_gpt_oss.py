"""GPU-only: gpt-oss's expert kernels compiled for the real device, bfloat16, gpt-oss-20b's expert
shapes (H = I = 2880) with fewer experts: the bf16 fused MoE with biases and the clamped SwiGLU, and
the MXFP4 one, each against the dequantize-then-reference computation."""

import pytest
import torch

from engine.kernels.activation import ClampedSwiGLU
from engine.kernels.fused_moe import fused_moe_reference, fused_moe_triton
from engine.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_triton
from engine.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BF16 = torch.bfloat16
EXPERTS, HIDDEN, INTER = 8, 2880, 2880


@pytest.fixture(scope="module")
def experts():  # type: ignore[no-untyped-def]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = quantize_mxfp4(torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) / 50)
    w2 = quantize_mxfp4(torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / 50)
    biases = {"w13_bias": (torch.randn(EXPERTS, 2 * INTER, device="cuda") / 10).to(BF16),
              "w2_bias": (torch.randn(EXPERTS, HIDDEN, device="cuda") / 10).to(BF16)}
    return w13, w2, biases


@pytest.mark.parametrize("num_tokens", [1, 100, 700])
def test_gpt_oss_experts_bf16_and_mxfp4_match_the_reference(experts, num_tokens):  # type: ignore[no-untyped-def]
    (w13_blocks, w13_scales), (w2_blocks, w2_scales), biases = experts
    w13, w2 = (dequantize_mxfp4(w13_blocks, w13_scales, BF16),
               dequantize_mxfp4(w2_blocks, w2_scales, BF16))
    x = torch.randn(num_tokens, HIDDEN, device="cuda").to(BF16)
    top, ids = torch.topk(torch.randn(num_tokens, EXPERTS, device="cuda"), 4, dim=-1)
    weights, ids = torch.softmax(top, dim=-1), ids.to(torch.int32)
    extra = {**biases, "activation": ClampedSwiGLU()}
    expected = fused_moe_reference(x, w13, w2, weights, ids, **extra).float()
    dense = fused_moe_triton(x, w13, w2, weights, ids, **extra).float()
    packed = fused_moe_mxfp4_triton(x, w13_blocks, w13_scales, w2_blocks, w2_scales, weights, ids,
                                    **extra).float()
    for out in (dense, packed):
        torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
