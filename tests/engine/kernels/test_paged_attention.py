"""Paged attention: reference vs naive dense attention, Triton (interpreter on CPU) vs reference."""

import pytest
import torch

from engine.kernels.paged_attention import paged_attention_reference, paged_attention_triton
from engine.kernels.paged_decode import choose_num_splits
from engine.kernels.store_kv import store_kv_reference, store_kv_triton
from tests.engine.kernels._util import DEVICE, DTYPES, assert_close

BLOCK_SIZE = 16


def make_batch(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=BLOCK_SIZE):
    """Dense per-request K/V scattered into shuffled cache blocks; returns (kernel args, dense)."""
    max_blocks = max(-(-c // block_size) for c in ctx_lens)
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 3
    perm = torch.randperm(num_blocks).tolist()
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
    dense_k, dense_v = [], []
    for i, ctx in enumerate(ctx_lens):
        nb = -(-ctx // block_size)
        blocks = [perm.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(ctx, num_kv_heads, head_dim, dtype=dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, dtype=dtype)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size
                              for p in range(ctx)])
        store_kv_reference(k, v, k_cache, v_cache, slots)
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    args = [t.to(DEVICE) for t in (q, k_cache, v_cache, cu, seq_lens, tables)]
    return args, (dense_k, dense_v)


def naive_attention(q, cu, dense_k, dense_v, scale):
    """Plain causal softmax attention on unpaged K/V, float64, one head at a time."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (k, v) in enumerate(zip(dense_k, dense_v, strict=True)):
        start, end = int(cu[i]), int(cu[i + 1])
        ctx, n = k.shape[0], end - start
        group = q.shape[1] // k.shape[1]
        for h in range(q.shape[1]):
            kh, vh = k[:, h // group].double(), v[:, h // group].double()  # [ctx, D]
            scores = q[start:end, h].double() @ kh.T * scale  # [n, ctx]
            allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[start:end, h] = torch.softmax(scores, -1) @ vh
    return out


CASES = {
    # name: (ctx_lens, q_lens)
    "single_token": ([1], [1]),
    "block_boundaries_prefill": ([15, 16, 17, 33], [15, 16, 17, 33]),
    "decode_only": ([15, 16, 17, 33, 40], [1, 1, 1, 1, 1]),
    "mixed_prefill_decode": ([17, 40, 1, 9], [17, 1, 1, 5]),
    "long_cached_prefix": ([130, 105], [3, 2]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_naive_dense_attention(case):
    ctx_lens, q_lens = CASES[case]
    args, (dk, dv) = make_batch(ctx_lens, q_lens, 6, 2, 64, torch.float32)
    args = [t.cpu() for t in args]
    out = paged_attention_reference(*args, scale=0.125)
    expected = naive_attention(args[0], args[3], dk, dv, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_matches_reference(case, dtype):
    ctx_lens, q_lens = CASES[case]
    args, _ = make_batch(ctx_lens, q_lens, 6, 2, 64, dtype)
    out = paged_attention_triton(*args, scale=0.125)
    assert_close(out, paged_attention_reference(*args, scale=0.125), dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_split_kv_decode_is_independent_of_split_count(num_splits):
    args, _ = make_batch([100, 33, 7], [1, 1, 1], 4, 1, 32, torch.float32)
    out = paged_attention_triton(*args, scale=0.2, num_splits=num_splits)
    assert_close(out, paged_attention_reference(*args, scale=0.2), torch.float32)


def test_non_power_of_two_head_dim_and_block_size():
    args, _ = make_batch([21, 9], [4, 1], 4, 4, 40, torch.float32, block_size=12)
    out = paged_attention_triton(*args, scale=0.3)
    assert_close(out, paged_attention_reference(*args, scale=0.3), torch.float32)


def test_split_rule_splits_small_batches_and_not_large_ones():
    assert choose_num_splits(1, 8, 32768, num_sms=132) > 1
    assert choose_num_splits(256, 8, 32768, num_sms=132) == 1
    assert choose_num_splits(1, 8, 100, num_sms=132) == 1  # too short to be worth splitting


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_each_token_to_its_slot(dtype):
    k_cache = torch.zeros(4, BLOCK_SIZE, 2, 64, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, 2, 64, dtype=dtype, device=DEVICE)
    v = torch.randn_like(k)
    slots = torch.tensor([3 * BLOCK_SIZE + 15, 0, 17, 2 * BLOCK_SIZE, 5], device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(k, v, ref_k, ref_v, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert torch.equal(ref_k[3, 15], k[0]) and torch.equal(ref_v[1, 1], v[2])
    assert ref_k[0, 1:5].abs().sum() == 0  # untouched slots stay untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_decodes_first_hint_routes_them_to_the_decode_kernel_with_same_result(dtype):
    ctx_lens, q_lens = [33, 7, 100, 17, 40], [1, 1, 1, 17, 6]  # three decodes, then prefills
    args, _ = make_batch(ctx_lens, q_lens, 6, 2, 64, dtype)
    out = paged_attention_triton(*args, scale=0.125, max_query_len=17, max_seq_len=100,
                                 num_decode_seqs=3)
    assert_close(out, paged_attention_reference(*args, scale=0.125), dtype)
