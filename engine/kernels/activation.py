"""SiLU-and-mul (SwiGLU gate): x [T, 2*I] -> silu(x[:, :I]) * x[:, I:]  [T, I].

Math in fp32, output in the input dtype. Triton is imported only when the kernel is first built.
`ClampedSwiGLU` is gpt-oss's variant (the fused MoE kernel applies it in its epilogue).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from engine.kernels.launch import check_row_major, check_same_device


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] -> [T, I], computed in fp32 and cast back."""
    inter = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :inter]) * xf[..., inter:]).to(x.dtype)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation over x [..., 2I] (gate half first, then up):
    gate = min(gate, limit), up = clamp(up, -limit, limit), out = (up + 1) * gate * sigmoid(alpha *
    gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if not self.limit > 0:
            raise ValueError(f"swiglu limit must be positive, got {self.limit}")


def clamped_swiglu_reference(x: torch.Tensor, act: ClampedSwiGLU) -> torch.Tensor:
    """x [T, 2*I] -> [T, I] in x's dtype (transformers' GptOssExperts._apply_gate on the split
    halves)."""
    inter = x.shape[-1] // 2
    gate = x[..., :inter].clamp(max=act.limit)
    up = x[..., inter:].clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter,
                            BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(triton=triton, silu_and_mul=silu_and_mul_kernel)


def silu_and_mul_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2*I] -> out [T, I] (allocated when not given)."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2*I], got {tuple(x.shape)}"
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, inter) and out.dtype == x.dtype
    check_same_device(x, out)
    check_row_major(x, "x")
    check_row_major(out, "out")
    if num_tokens == 0:
        return out
    k = _kernels()
    block = min(1024, k.triton.next_power_of_2(inter))
    grid = (num_tokens, k.triton.cdiv(inter, block))
    k.silu_and_mul[grid](x, out, x.stride(0), out.stride(0), inter, BLOCK=block)
    return out
