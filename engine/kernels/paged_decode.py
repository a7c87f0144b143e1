"""Split-KV ("flash-decoding") attention for decode-only batches over a paged KV cache.

Every request has exactly one new token, so q row i belongs to request i. Legend as in
paged_attention.py (S requests, H heads, KVH kv heads, G = H // KVH, D head_dim, P splits).

    stage 1  grid (S, KVH, P): the G query heads of one kv head attend to one contiguous chunk
             of the context (K/V loaded once per group) -> partial out [S, H, P, D] fp32 and
             log-sum-exp [S, H, P] fp32 (log2 domain; an empty chunk writes lse = -inf)
    stage 2  grid (S, H): out = sum_p exp2(lse_p - max) * partial_p / sum_p exp2(lse_p - max)

Sliding window W: request i attends to positions [max(0, seq_len - W), seq_len), and the splits cut
that range (chunks sized for min(max_seq_len, W)). Sinks [H]: stage 2 adds exp2(sink * log2 e - max)
to its denominator.

Split rule (`choose_num_splits`): split only while the grid (S * KVH programs) would leave the
GPU's SMs idle, and never below MIN_TOKENS_PER_SPLIT positions per split.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from engine.kernels.launch import interpreting

MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough programs for ~2 waves of `num_sms`, each split covering >= MIN_TOKENS_PER_SPLIT."""
    programs = num_seqs * num_kv_heads
    wanted = -(-2 * num_sms // programs)
    by_length = -(-max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr,
                     bt_ptr, qk_scale_log2, window, chunk,
                     stride_qt, stride_qh,
                     stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                     stride_ps, stride_ph, stride_pp, stride_ls, stride_lh,
                     block_size, head_dim, chunk_len,
                     GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = 0
        if HAS_WINDOW:
            first_pos = tl.maximum(seq_len - window, 0)
        if HAS_CHUNK:  # the query at seq_len - 1 sees its own chunk only
            first_pos = (seq_len - 1) // chunk * chunk
        start_pos = first_pos + split * chunk_len
        end_pos = tl.minimum(start_pos + chunk_len, seq_len)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_valid = offs_g < GROUP
        d_valid = offs_d < head_dim
        heads = kv_head * GROUP + offs_g  # [BLOCK_G] query heads of this kv head
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                    + offs_d[None, :], mask=g_valid[:, None] & d_valid[None, :], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        table = bt_ptr + seq.to(tl.int64) * stride_bt
        for start in range(start_pos, end_pos, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < end_pos
            blk = tl.load(table + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
            slot = (offs_n % block_size).to(tl.int64)
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(k_cache_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ks
                        + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs
                        + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale_log2  # [BLOCK_G, BLOCK_N]
            s = tl.where(n_valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the tile's first position is valid
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        nonempty = l_i > 0
        acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        base = seq.to(tl.int64) * stride_ps + split * stride_pp
        tl.store(part_out_ptr + base + heads[:, None] * stride_ph + offs_d[None, :], acc,
                 mask=g_valid[:, None] & d_valid[None, :])
        tl.store(part_lse_ptr + seq.to(tl.int64) * stride_ls + heads * stride_lh + split, lse,
                 mask=g_valid)

    @triton.jit
    def reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr,
                      stride_ps, stride_ph, stride_pp, stride_ls, stride_lh, stride_ot, stride_oh,
                      num_splits, head_dim, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                      HAS_SINKS: tl.constexpr):
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs_p = tl.arange(0, BLOCK_P)
        offs_d = tl.arange(0, BLOCK_D)
        p_valid = offs_p < num_splits
        lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + offs_p, mask=p_valid,
                      other=float("-inf"))
        peak = tl.max(lse, axis=0)  # split 0 is never empty, so the peak is finite
        weight = tl.exp2(lse - peak)
        part = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph
                       + offs_p[:, None] * stride_pp + offs_d[None, :],
                       mask=p_valid[:, None] & (offs_d[None, :] < head_dim), other=0.0)
        total = tl.sum(weight, axis=0)
        if HAS_SINKS:
            total += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - peak)
        out = tl.sum(part * weight[:, None], axis=0) / total
        tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d,
                 out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)

    return SimpleNamespace(triton=triton, split=split_kernel, reduce=reduce_kernel)


def paged_decode_triton(q, k_cache, v_cache, seq_lens, block_tables, scale, *, max_seq_len: int,
                        out: torch.Tensor, num_splits: int | None = None,
                        sliding_window: int | None = None,
                        sinks: torch.Tensor | None = None,
                        attention_chunk: int | None = None) -> torch.Tensor:
    """Decode-only attention; inputs checked by paged_attention_triton. q [S, H, D] -> out."""
    kern = _kernels()
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert seq_lens.shape[0] == num_seqs, "decode batches have one query row per request"
    group = num_heads // num_kv_heads
    if sliding_window is not None:
        max_seq_len = min(max_seq_len, sliding_window)  # the longest span any request attends to
    if attention_chunk is not None:
        max_seq_len = min(max_seq_len, attention_chunk)
    if num_splits is None:
        num_sms = (4 if interpreting()
                   else torch.cuda.get_device_properties(q.device).multi_processor_count)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms)
    block_n = 16 if interpreting() else 64
    chunk_len = kern.triton.cdiv(kern.triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = kern.triton.cdiv(max_seq_len, chunk_len)
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = kern.triton.next_power_of_2(head_dim)
    kern.split[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, part_out, part_lse, seq_lens, block_tables, scale * 1.4426950408889634,
        sliding_window or 0, attention_chunk or 1, q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        k_cache.shape[1], head_dim, chunk_len,
        GROUP=group, BLOCK_G=max(16, kern.triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=block_d, HAS_WINDOW=sliding_window is not None,
        HAS_CHUNK=attention_chunk is not None, num_warps=4,
    )
    kern.reduce[(num_seqs, num_heads)](
        part_out, part_lse, out, sinks if sinks is not None else part_lse,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        num_splits, head_dim, BLOCK_P=max(2, kern.triton.next_power_of_2(num_splits)),
        BLOCK_D=block_d, HAS_SINKS=sinks is not None,
    )
    return out
