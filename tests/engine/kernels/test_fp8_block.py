"""The block-scaled FP8 GEMM (engine/kernels/fp8_block.py) against its torch reference and the float
linear, in Triton's interpreter on the CPU (small blocks, partial N and K blocks) and at a
checkpoint's 128 x 128 blocks on a GPU; FP8BlockLinear's fused-part joining."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.fp8_block import (
    dequantize_blocks,
    fp8_block_gemm_reference,
    fp8_block_gemm_triton,
    fp8_block_linear_w8a8,
    fp8_block_linear_weight_only,
    quantize_activation_per_group,
    quantize_weight_blocks,
)
from engine.layers.fp8_block_linear import FP8BlockLinear
from engine.loader.fp8_blocks import dequantize_block
from tests.engine.kernels._util import DEVICE, DTYPES, assert_close


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    wq, scale = quantize_weight_blocks(w, block)
    assert scale.shape == (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    return wq, scale


def test_activation_groups_are_scaled_apart() -> None:
    x = torch.randn(3, 40)
    x[1, 16:32] *= 1000  # one group of one token far larger
    xq, scale = quantize_activation_per_group(x, 16)
    assert xq.shape == (3, 40) and scale.shape == (3, 3)
    back = xq.float() * scale.repeat_interleave(16, dim=1)[:, :40]
    torch.testing.assert_close(back, x, rtol=0.07, atol=1e-3 * 1000)
    assert scale[1, 1] > 100 * scale[1, 0]


def test_the_layers_dequantization_is_the_loaders() -> None:
    wq, scale = quantize_blocks(torch.randn(40, 72), (16, 32))
    torch.testing.assert_close(dequantize_blocks(wq, scale, (16, 32), torch.float32),
                               dequantize_block(wq, scale, (16, 32)), rtol=0, atol=0)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "block"), [(1, 24, 72, (16, 32)), (37, 48, 96, (16, 16)),
                                                   (20, 64, 64, (32, 64))])
def test_the_block_kernel_matches_the_reference(m: int, n: int, k: int, block: tuple[int, int],
                                                out_dtype: torch.dtype) -> None:
    xq, xs = quantize_activation_per_group(torch.randn(m, k), block[1])
    wq, ws = quantize_blocks(torch.randn(n, k), block)
    args = [t.to(DEVICE) for t in (xq, wq, xs, ws)]
    out = fp8_block_gemm_triton(*args, block, out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert_close(out, fp8_block_gemm_reference(*args, block, out_dtype), out_dtype)


def test_both_paths_approximate_the_float_linear() -> None:
    x = torch.randn(6, 96, device=DEVICE)
    w = torch.randn(40, 96, device=DEVICE) / 96 ** 0.5
    w[:16, :32] *= 50  # one block far larger: per-block scales keep the rest precise
    exact = x @ w.T
    wq, ws = quantize_blocks(w, (16, 32))
    for out in (fp8_block_linear_weight_only(x, wq, ws, (16, 32)),
                fp8_block_linear_w8a8(x, wq, ws, (16, 32))):
        err = (out.float() - exact).abs()
        assert err[:, 16:].max() < 0.08 * exact[:, 16:].abs().max()
        assert err[:, :16].max() < 0.08 * exact[:, :16].abs().max()


def test_fused_parts_join_only_on_whole_n_blocks() -> None:
    q, k = (quantize_blocks(torch.randn(32, 64), (16, 32)),
            quantize_blocks(torch.randn(20, 64), (16, 32)))
    joined = FP8BlockLinear.concat([q, k], (16, 32), torch.float32)
    assert joined is not None and joined.wq.shape == (52, 64) and joined.w_scale.shape == (4, 2)
    x = torch.randn(3, 64)
    torch.testing.assert_close(joined(x), torch.cat([FP8BlockLinear(*q, (16, 32), torch.float32)(x),
                                                     FP8BlockLinear(*k, (16, 32),
                                                                    torch.float32)(x)], 1))
    assert FP8BlockLinear.concat([k, q], (16, 32), torch.float32) is None  # 20 rows: a shared block
    assert joined.nbytes == 52 * 64 + 4 * 2 * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_block_kernel_on_gpu_at_checkpoint_blocks() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("native FP8 dot needs compute capability >= 8.9")
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    # a partial N block
    wq, ws = quantize_blocks(torch.randn(1000, 4096, device="cuda"), (128, 128))
    xq, xs = quantize_activation_per_group(x, 128)
    out = fp8_block_gemm_triton(xq, wq, xs, ws, (128, 128), torch.bfloat16)
    torch.testing.assert_close(out.float(), fp8_block_gemm_reference(xq, wq, xs, ws, (128, 128),
                                                                     torch.float32),
                               atol=0.05, rtol=0.02)
    layer = FP8BlockLinear(wq, ws, (128, 128), torch.bfloat16)
    exact = x.float() @ dequantize_blocks(wq, ws, (128, 128), torch.float32).T
    assert (layer(x).float() - exact).abs().max() < 0.05 * exact.abs().max()
