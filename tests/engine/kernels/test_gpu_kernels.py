"""GPU-only checks: every Triton kernel compiled for the real device, bfloat16, larger shapes."""

import pytest
import torch

from engine.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from engine.kernels.fused_moe import fused_moe_reference, fused_moe_triton, select_experts
from engine.kernels.paged_attention import paged_attention_reference, paged_attention_triton
from engine.kernels.rmsnorm import rms_norm_reference, rms_norm_triton
from engine.kernels.rotary import apply_rotary_reference, apply_rotary_triton
from tests.engine.kernels.test_paged_attention import make_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BF16 = torch.bfloat16


def close(a, b, tol=3e-2):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("ctx_lens,q_lens", [
    ([700, 33, 2048, 17], [700, 1, 64, 1]),  # mixed prefill + decode, cached prefix
    ([4096, 1000, 1, 77], [1, 1, 1, 1]),  # decode-only, split-KV
])
def test_paged_attention_bf16(ctx_lens, q_lens):
    args, _ = make_batch(ctx_lens, q_lens, 32, 8, 128, BF16)
    out = paged_attention_triton(*args, scale=128**-0.5)
    close(out, paged_attention_reference(*args, scale=128**-0.5))


@pytest.mark.parametrize("num_tokens", [1, 100, 700])
def test_fused_moe_bf16(num_tokens):
    h = torch.randn(num_tokens, 1024, device="cuda", dtype=BF16)
    w13 = (torch.randn(8, 2 * 1408, 1024, device="cuda") / 32).to(BF16)
    w2 = (torch.randn(8, 1024, 1408, device="cuda") / 1408**0.5).to(BF16)
    weights, ids = select_experts(torch.randn(num_tokens, 8, device="cuda"), 2, renormalize=True)
    close(fused_moe_triton(h, w13, w2, weights, ids), fused_moe_reference(h, w13, w2, weights, ids))


def test_elementwise_kernels_bf16():
    x = torch.randn(300, 4096, device="cuda", dtype=BF16)
    res = torch.randn_like(x)
    w = torch.rand(4096, device="cuda", dtype=BF16)
    for got, ref in zip(rms_norm_triton(x, w, 1e-5, res), rms_norm_reference(x, w, 1e-5, res),
                        strict=True):
        close(got, ref)
    close(silu_and_mul_triton(x), silu_and_mul_reference(x))
    q = torch.randn(300, 32, 128, device="cuda", dtype=BF16)
    k = torch.randn(300, 8, 128, device="cuda", dtype=BF16)
    freqs = torch.outer(torch.arange(4096.0, device="cuda"), torch.rand(64, device="cuda"))
    pos = torch.randint(0, 4096, (300,), device="cuda")
    q2, k2 = q.clone(), k.clone()
    apply_rotary_triton(q, k, pos, freqs.cos(), freqs.sin())
    apply_rotary_reference(q2, k2, pos, freqs.cos(), freqs.sin())
    close(q, q2)
    close(k, k2)
