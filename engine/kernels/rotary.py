"""Rotary position embedding, rotate-half (NeoX / HF llama) style, applied IN PLACE.

q [T, n_heads, head_dim], k [T, n_kv_heads, head_dim], positions [T] (int), cos_cache and
sin_cache [max_pos, rotary_dim // 2] with rotary_dim <= head_dim (rotary_dim == head_dim for llama).
For each head, with x1 = x[:half], x2 = x[half:rotary_dim] (half = rotary_dim // 2):

    x1' = x1 * cos - x2 * sin
    x2' = x2 * cos + x1 * sin

dims past rotary_dim are left alone. Math in fp32. Triton is imported only when first built.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from engine.kernels.launch import check_row_major, check_same_device


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = cos.shape[-1]
    x1 = x[..., :half]  # [T, heads, half]
    x2 = x[..., half : 2 * half]
    x1f, x2f = x1.float(), x2.float()
    new1 = x1f * cos - x2f * sin
    new2 = x2f * cos + x1f * sin
    x1.copy_(new1)
    x2.copy_(new2)


def apply_rotary_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Rotate q and k in place (see module docstring)."""
    cos = cos_cache[positions].float().unsqueeze(1)  # [T, 1, half]
    sin = sin_cache[positions].float().unsqueeze(1)
    _rotate_(q, cos, sin)
    _rotate_(k, cos, sin)


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_cos, stride_sin,
                      num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_HALF: tl.constexpr):
        """One program per token: rotate all heads of x[tok] in place."""
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_HALF)
        cos = tl.load(cos_ptr + pos * stride_cos + dims, mask=dims < HALF, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_sin + dims, mask=dims < HALF, other=0.0)
        cos = cos.to(tl.float32)[None, :]
        sin = sin.to(tl.float32)[None, :]
        mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
        # [BLOCK_H, BLOCK_HALF]
        p1 = x_ptr + tok * stride_t + heads[:, None] * stride_h + dims[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(triton=triton, rotary=rotary_kernel)


def apply_rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Same contract as `apply_rotary_reference`."""
    assert q.dim() == 3 and k.dim() == 3, "q, k must be [T, heads, head_dim]"
    num_tokens, num_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, (f"k {tuple(k.shape)} vs q "
                                                                 f"{tuple(q.shape)}")
    assert positions.shape == (num_tokens,) and not positions.is_floating_point()
    assert cos_cache.shape == sin_cache.shape and cos_cache.dim() == 2
    half = cos_cache.shape[1]
    assert 2 * half <= head_dim, f"rotary_dim {2 * half} > head_dim {head_dim}"
    assert q.dtype == k.dtype
    for t, name in ((q, "q"), (k, "k"), (cos_cache, "cos_cache"), (sin_cache, "sin_cache")):
        check_row_major(t, name)
    check_same_device(q, k, positions, cos_cache, sin_cache)
    if num_tokens == 0:
        return
    k_ = _kernels()
    np2 = k_.triton.next_power_of_2
    for x in (q, k):
        k_.rotary[(num_tokens,)](
            x, positions, cos_cache, sin_cache,
            x.stride(0), x.stride(1), cos_cache.stride(0), sin_cache.stride(0),
            x.shape[1], HALF=half, BLOCK_H=np2(x.shape[1]), BLOCK_HALF=np2(half),
        )
