"""Write the batch's new K/V into the paged cache.

k, v [T, num_kv_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
slot_mapping [T] int64 with slot = block_id * block_size + offset_in_block. Every slot must be valid
(callers drop padding tokens before the call). Triton is imported only when the kernel is first
built.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from engine.kernels.launch import check_same_device


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k/v rows into the caches at `slot_mapping` (in place)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)  # [slots, kvh, D]
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                        stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
                        num_kv_heads, head_dim,
                        BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        k = tl.load(k_ptr + tok * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + heads * stride_vh + dims, mask=mask)
        k_dst = k_cache_ptr + block * stride_cb + offset * stride_cs + heads * stride_ch + dims
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(triton=triton, store_kv=store_kv_kernel)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `store_kv_reference`."""
    assert k.dim() == 3 and k.shape == v.shape, f"k {tuple(k.shape)} / v {tuple(v.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), f"cache {tuple(k_cache.shape)} vs k"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    for t, name in ((k, "k"), (v, "v"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        assert t.stride(-1) == 1, f"{name} needs a unit-stride head_dim"
    check_same_device(k, v, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    kern = _kernels()
    np2 = kern.triton.next_power_of_2
    kern.store_kv[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=np2(num_kv_heads), BLOCK_D=np2(head_dim),
    )
