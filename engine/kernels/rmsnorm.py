"""RMSNorm with an optional fused residual add.

    new_residual = x + residual            (when a residual is given; else x)
    normed       = new_residual * rsqrt(mean(new_residual^2) + eps) * weight

x, residual [T, H]; weight [H]. Sums and the norm are fp32; both outputs are in x's dtype, and the
norm is taken of the fp32 sum (before rounding it to the residual dtype), as vLLM's fused kernel
does. Triton is imported only when the kernel is first built.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from engine.kernels.launch import check_row_major, check_same_device


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (normed [T, H], new_residual [T, H] or None when no residual was given)."""
    xf = x.float()
    if residual is not None:
        xf = xf + residual.float()
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    normed = (xf * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)
    return normed, (xf.to(x.dtype) if residual is not None else None)


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                        stride_x, stride_res, stride_out, stride_res_out, hidden, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(res_out_ptr + row * stride_res_out + cols,
                     x.to(res_out_ptr.dtype.element_ty), mask=mask)
        variance = tl.sum(x * x, axis=0) / hidden
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(variance + eps) * w
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(triton=triton, rms_norm=rms_norm_kernel)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `rms_norm_reference`; outputs are new tensors."""
    assert x.dim() == 2, f"x must be [T, H], got {tuple(x.shape)}"
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} != ({hidden},)"
    check_row_major(x, "x")
    check_row_major(weight, "weight")
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        check_row_major(residual, "residual")
        check_same_device(x, weight, residual)
    else:
        check_same_device(x, weight)
    if num_tokens == 0:
        return out, res_out
    k = _kernels()
    block = k.triton.next_power_of_2(hidden)
    num_warps = min(16, max(1, block // 256))
    res_in = residual if residual is not None else x
    res_o = res_out if res_out is not None else out
    k.rms_norm[(num_tokens,)](
        x, res_in, weight, out, res_o,
        x.stride(0), res_in.stride(0), out.stride(0), res_o.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
    )
    return out, res_out
