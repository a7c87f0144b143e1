"""Native CPU decode kernels (engine/kernels/cpu) against PyTorch references: quantized linears over
the GGUF block layouts, their fused RMSNorm / SiLU-and-mul / residual forms, and paged decode
attention with rotary and the KV store. Skipped where the kernels cannot be built."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu as native
from engine.layers.attention import AttentionMetadata
from engine.layers.native_linear import to_native_blocks
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.layers.torch_attention import TorchPagedAttention

pytestmark = pytest.mark.skipif(not native.load(), reason="native CPU kernels unavailable here")


def quantized(ggml_type: str, out_features: int, in_features: int, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(dense float32 weight as the file stores it, kernel blocks, kernel weight type)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.1
    qtype = getattr(gguf.GGMLQuantizationType, ggml_type)
    raw = gguf.quants.quantize(weight, qtype)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(out_features,
                                                                        in_features).copy())
    blocks, weight_type = to_native_blocks(ggml_type, raw)
    return dense, blocks, weight_type


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out - expected).norm() / expected.norm())


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_linear_approximates_the_dequantized_product(ggml_type: str) -> None:
    dense, blocks, weight_type = quantized(ggml_type, 96, 128)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    out = torch.ops.aigw_cpu.q_linear(x, blocks, weight_type, None, 0.0, False)
    assert out.shape == (5, 96)
    assert relative_error(out, x @ dense.T) < 0.01  # only the 8-bit activation blocks differ


@pytest.mark.parametrize("num_rows", [7, 70])  # 70: the many-row (prefill) form of the Q4 kernel
def test_each_row_is_computed_the_same_whatever_the_batch(num_rows: int) -> None:
    _, blocks, weight_type = quantized("Q4_1", 64, 96)
    x = torch.randn(num_rows, 96, generator=torch.Generator().manual_seed(2))
    batched = torch.ops.aigw_cpu.q_linear(x, blocks, weight_type, None, 0.0, False)
    for i in range(num_rows):
        alone = torch.ops.aigw_cpu.q_linear(x[i:i + 1], blocks, weight_type, None, 0.0, False)
        assert torch.equal(alone[0], batched[i])


def test_fused_rms_norm_silu_and_mul_and_residual_add_match_their_unfused_forms() -> None:
    dense, blocks, weight_type = quantized("Q4_1", 64, 96)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 96, generator=gen)
    norm_weight = torch.rand(96, generator=gen) + 0.5
    normed = torch.ops.aigw_cpu.q_linear(x, blocks, weight_type, norm_weight, 1e-5, False)
    assert relative_error(normed, F.rms_norm(x, (96,), norm_weight, 1e-5) @ dense.T) < 0.01
    gate_up = torch.randn(3, 192, generator=gen)
    residual = torch.randn(3, 64, generator=gen)
    out = residual.clone()
    torch.ops.aigw_cpu.q_linear_add_(out, gate_up, blocks, weight_type, True)
    expected = residual + (F.silu(gate_up[:, :96]) * gate_up[:, 96:]) @ dense.T
    assert relative_error(out, expected) < 0.01


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decode_attention_matches_the_torch_backend_and_stores_rotated_kv(
        cache_dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 6, 2, 16, 4, 12
    gen = torch.Generator().manual_seed(4)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    tables = [[3, 7, 1], [10, 2, 0], [5, 0, 0]]  # padded with block 0
    lens = [11, 6, 1]  # context after this step, the new token included
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([t[p // block_size] * block_size + p % block_size
                          for t, p in zip(tables, positions.tolist(), strict=True)])
    qkv = torch.randn(3, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0)
    scale = head_dim ** -0.5

    k_ours, v_ours = k_cache.clone(), v_cache.clone()
    out = torch.ops.aigw_cpu.decode_attention(qkv, rotary.cos, rotary.sin, positions, k_ours,
                                              v_ours, slots, torch.tensor(tables),
                                              torch.tensor(lens), num_heads, num_kv_heads, scale)

    heads = qkv.view(3, num_heads + 2 * num_kv_heads, head_dim)
    cos, sin = rotary.lookup(positions)
    qk = apply_rotary(heads[:, :num_heads + num_kv_heads], cos, sin)
    width = max(lens)
    valid = torch.arange(width)[None, :] < torch.tensor(lens)[:, None]
    mask = torch.zeros(3, 1, 1, width).masked_fill_(~valid.view(3, 1, 1, width), float("-inf"))
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=3,
                             decode_blocks=torch.tensor(tables),
                             decode_len=width, decode_mask=mask, prefills=())
    expected = TorchPagedAttention().forward(qk[:, :num_heads], qk[:, num_heads:],
                                             heads[:, num_heads + num_kv_heads:],
                                             k_cache, v_cache, scale, meta)
    tolerance = 1e-5 if cache_dtype == torch.float32 else 1e-3
    torch.testing.assert_close(k_ours, k_cache, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(v_ours, v_cache)
    torch.testing.assert_close(out.view(3, num_heads, head_dim), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_prefill_chunk_rows_attend_causally_and_match_each_row_computed_alone(
        cache_dtype: torch.dtype) -> None:
    """A prefill chunk as rows of one sequence (the q4 mode's prefill): the kernel tiles such rows
    and walks the context in chunks; each row must come out bit-identical to the row alone, and
    match causal SDPA over the cached prefix plus the chunk."""
    # head_dim 40: a 32-wide and an 8-wide part
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 40, 4
    num_cached, num_new = 7, 150  # crosses the kernel's row tiles and context chunks
    gen = torch.Generator().manual_seed(5)
    num_blocks = -(-(num_cached + num_new) // block_size)
    # scattered, never block 0
    blocks = torch.randperm(num_blocks + 3, generator=gen)[:num_blocks] + 1
    shape = (num_blocks + 4, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    positions = torch.arange(num_cached, num_cached + num_new)
    slots = blocks[positions // block_size] * block_size + positions % block_size
    tables = blocks.expand(num_new, -1).contiguous()
    qkv = torch.randn(num_new, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    rotary = RotaryEmbedding(head_dim, 256, 10000.0)
    scale = head_dim ** -0.5

    def attend(rows: slice) -> torch.Tensor:
        return torch.ops.aigw_cpu.decode_attention(qkv[rows], rotary.cos, rotary.sin,
                                                   positions[rows], k_cache,
                                                   v_cache, slots[rows], tables[rows],
                                                   positions[rows] + 1, num_heads, num_kv_heads,
                                                   scale)

    out = attend(slice(None))
    for i in [0, 1, 15, 16, 17, 100, num_new - 1]:
        assert torch.equal(attend(slice(i, i + 1))[0], out[i])

    heads = qkv.view(num_new, num_heads + 2 * num_kv_heads, head_dim)
    cos, sin = rotary.lookup(positions)
    q = apply_rotary(heads[:, :num_heads], cos, sin)  # [T, H, Dh]
    context = num_cached + num_new
    # [C, G, Dh], the chunk's rotated keys included
    k = k_cache[blocks].flatten(0, 1)[:context].float()
    v = v_cache[blocks].flatten(0, 1)[:context].float()
    causal = torch.arange(context)[None, :] <= positions[:, None]  # [T, C]
    expected = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], attn_mask=causal,
                                              scale=scale,
                                              enable_gqa=True)[0].transpose(0, 1)  # [T, H, Dh]
    torch.testing.assert_close(out.view(num_new, num_heads, head_dim), expected, rtol=1e-4,
                               atol=1e-5)


# decode steps of 5 and 20 rows, a prefill chunk of 70 (a 2-row last tile)
@pytest.mark.parametrize("num_rows", [5, 20, 70])
@pytest.mark.parametrize("in_features", [96, 1536])  # 1,536: the down projection's width
# 72: 9 column groups, the last one without a pair
@pytest.mark.parametrize("out_features", [64, 72])
def test_many_row_q4_kernel_gives_each_row_what_the_one_row_kernel_gives(
        num_rows: int, in_features: int, out_features: int) -> None:
    """From 4 rows the Q4 kernel reads pre-broadcast activations, 4 rows x 2 column groups at a time
    where it can; rows must come out bit-identical to the row alone (the one-row kernel), so a
    decode row does not depend on its batch."""
    _, blocks, weight_type = quantized("Q4_1", out_features, in_features, seed=6)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(7))
    residual = torch.randn(num_rows, out_features, generator=torch.Generator().manual_seed(8))
    batched = residual.clone()
    torch.ops.aigw_cpu.q_linear_add_(batched, x, blocks, weight_type, False)
    for i in range(num_rows):
        alone = residual[i:i + 1].clone()
        torch.ops.aigw_cpu.q_linear_add_(alone, x[i:i + 1], blocks, weight_type, False)
        assert torch.equal(alone[0], batched[i])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decode_rows_of_many_sequences_match_each_row_computed_alone(
        cache_dtype: torch.dtype) -> None:
    """With enough sequences for every thread an attention task takes all kv heads of a row and
    walks its context once; a row alone is split by kv head. Both must give the same bits."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 24, 4
    num_rows = 4 * torch.get_num_threads() + 3
    gen = torch.Generator().manual_seed(9)
    lens = torch.randint(1, 60, (num_rows,), generator=gen)
    width = -(-60 // block_size)
    num_blocks = num_rows * width + 1
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(num_rows, width)  # scattered
    positions = lens - 1
    slots = (tables.gather(1, (positions // block_size)[:, None])[:, 0] * block_size
             + positions % block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    qkv = torch.randn(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0)

    def attend(rows: slice) -> torch.Tensor:
        return torch.ops.aigw_cpu.decode_attention(qkv[rows], rotary.cos, rotary.sin,
                                                   positions[rows], k_cache,
                                                   v_cache, slots[rows], tables[rows], lens[rows],
                                                   num_heads, num_kv_heads, head_dim ** -0.5)

    batched = attend(slice(None))
    for i in range(num_rows):
        assert torch.equal(attend(slice(i, i + 1))[0], batched[i])
