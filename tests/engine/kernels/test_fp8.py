"""FP8: quantizers, the w8a8 Triton kernel (interpreter on CPU runs real fp8 dots), the CPU
weight-only path."""

import pytest
import torch

from engine.kernels.fp8 import (
    FP8_DTYPE,
    fp8_gemm_reference,
    fp8_gemm_triton,
    fp8_linear_w8a8,
    fp8_linear_weight_only,
    quantize_activation_per_token,
    quantize_weight_per_channel,
)
from tests.engine.kernels._util import DEVICE, DTYPES, assert_close


def test_weight_quantization_round_trips_within_fp8_precision():
    w = torch.randn(24, 72) * torch.linspace(0.01, 10, 24)[:, None]  # very different row ranges
    wq, scale = quantize_weight_per_channel(w)
    assert wq.dtype == FP8_DTYPE and scale.shape == (24,)
    assert torch.allclose(wq.float().abs().amax(dim=1), torch.full((24,), 448.0))
    deq = wq.float() * scale[:, None]
    rel = (deq - w).abs() / w.abs().amax(dim=1, keepdim=True)
    assert rel.max() < 2**-4  # E4M3 keeps 3 mantissa bits


def test_activation_quantization_scales_each_token_and_survives_zero_rows():
    x = torch.randn(5, 40)
    x[2] = 0.0
    xq, scale = quantize_activation_per_token(x)
    assert scale.shape == (5,) and torch.isfinite(xq.float()).all()
    assert xq[2].float().abs().sum() == 0
    torch.testing.assert_close(xq.float() * scale[:, None], x, atol=0.1, rtol=0.07)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 24, 72), (37, 40, 96)])
def test_w8a8_kernel_matches_reference(m, n, k, out_dtype):
    xq, xs = quantize_activation_per_token(torch.randn(m, k))
    wq, ws = quantize_weight_per_channel(torch.randn(n, k))
    args = [t.to(DEVICE) for t in (xq, wq, xs, ws)]
    out = fp8_gemm_triton(*args, out_dtype)
    assert out.dtype == out_dtype
    assert_close(out, fp8_gemm_reference(*args, out_dtype), out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_linear_paths_approximate_the_float_linear(dtype):
    x = torch.randn(6, 72, device=DEVICE)
    w = torch.randn(40, 72, device=DEVICE) / 72**0.5
    exact = x @ w.T
    wq, ws = quantize_weight_per_channel(w)
    weight_only = fp8_linear_weight_only(x.to(dtype), wq, ws)
    w8a8 = fp8_linear_w8a8(x.to(dtype), wq, ws)
    assert weight_only.dtype == dtype and w8a8.dtype == dtype
    scale = exact.abs().max()
    assert (weight_only.float() - exact).abs().max() < 0.05 * scale
    assert (w8a8.float() - exact).abs().max() < 0.08 * scale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_w8a8_kernel_on_gpu_at_realistic_size():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("native FP8 dot needs compute capability >= 8.9")
    xq, xs = quantize_activation_per_token(torch.randn(300, 4096, device="cuda"))
    wq, ws = quantize_weight_per_channel(torch.randn(1024, 4096, device="cuda"))
    out = fp8_gemm_triton(xq, wq, xs, ws, torch.bfloat16)
    torch.testing.assert_close(out.float(), fp8_gemm_reference(xq, wq, xs, ws, torch.float32),
                               atol=0.05, rtol=0.02)
