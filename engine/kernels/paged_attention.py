"""Attention for a mixed prefill + decode batch over a paged KV cache.

Dimension legend:
    T   new (query) tokens in the batch, requests concatenated     S   sequences (requests)
    H   query heads        KVH  kv heads (H % KVH == 0, G = H // KVH queries per kv head)
    D   head_dim           B    block_size (tokens per cache block)     NB  cache blocks

    q             [T, H, D]           this step's new tokens
    k/v_cache     [NB, B, KVH, D]     new tokens' K/V already stored (see store_kv.py)
    cu_query_lens [S + 1] int32       request i owns q rows cu[i] .. cu[i+1]
    seq_lens      [S] int32           context length of request i INCLUDING its new tokens
    block_tables  [S, max_blocks] int32   logical block j of request i -> physical cache block
    out           [T, H, D]

Causality: request i's first new token sits at position seq_lens[i] - query_len[i]; a query at
position p attends to cache positions 0..p.

    positions:  0 .......................... seq_len - q_len ...... seq_len - 1
                |<--- cached prefix ------->|<---- new tokens ---->|
    q row j sees positions <= seq_len - q_len + j

Sliding window W (optional): a query at position p sees only positions p-W+1 .. p (the kernels start
their loops at the window, so block-table entries before it are never read). Sinks [H] (optional,
float32): one logit per query head added to the softmax denominator, carrying no value.

Batches whose every request has query_len == 1 (decode-only) go to paged_decode.py (split-KV,
grouped-query); others to the kernel here. Triton is imported only when a kernel is first built.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from engine.kernels.launch import check_same_device
from engine.kernels.paged_decode import paged_decode_triton
from engine.kernels.tuning import pick_config, split_launch_options


def _gather_kv(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [NB, B, KVH, D], tables [S, nb] -> [S, KVH, nb*B, D] (positions in order)."""
    gathered = cache[tables]  # [S, nb, B, KVH, D]
    s, nb, b, kvh, d = gathered.shape
    return gathered.reshape(s, nb * b, kvh, d).transpose(1, 2)  # [S, KVH, nb*B, D]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, M, D], k/v [B, KVH, N, D], boolean mask broadcastable to [B, H, M, N] (True:
    visible; every row sees at least one key) -> [B, H, M, D]. sinks [H]: each head's logit joins
    the softmax denominator with no value (transformers' gpt_oss eager attention, computed in
    float32)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [B, H, N, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, M, N]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # [B, H, M, 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink dropped
    return torch.matmul(probs, v.float()).to(q.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Torch reference (the CPU engine's attention): same contract as the module docstring.
    `attention_chunk` C: a query at p sees floor(p / C) * C .. p only (Llama 4).

    Decode requests (query_len == 1) are batched into one padded call; prefill requests run one call
    each with a causal mask offset by their cached prefix (and the window, if any).
    """
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = cu_query_lens.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        idx = torch.tensor(decode, device=q.device)
        ctx = seq_lens[idx].to(torch.int64)  # [S_d]
        max_ctx = max(lens[i] for i in decode)
        nb = -(-max_ctx // block_size)
        tables = block_tables[idx, :nb].to(torch.int64)
        k = _gather_kv(k_cache, tables)  # [S_d, KVH, L, D]
        v = _gather_kv(v_cache, tables)
        rows = cu_query_lens[idx].to(torch.int64)
        q_d = q[rows].unsqueeze(2)  # [S_d, H, 1, D]
        pos = torch.arange(k.shape[2], device=q.device)
        visible = pos[None, :] < ctx[:, None]  # [S_d, L]
        if sliding_window is not None:
            visible &= pos[None, :] >= ctx[:, None] - sliding_window
        if attention_chunk is not None:
            visible &= pos[None, :] >= (ctx[:, None] - 1) // attention_chunk * attention_chunk
        o = dense_attention(q_d, k, v, scale, visible[:, None, None, :], sinks)
        out[rows] = o.squeeze(2)
    for i, n in enumerate(q_lens):
        if n <= 1:
            continue
        ctx_len = lens[i]
        nb = -(-ctx_len // block_size)
        tables = block_tables[i : i + 1, :nb].to(torch.int64)
        k = _gather_kv(k_cache, tables)[:, :, :ctx_len]  # [1, KVH, L, D]
        v = _gather_kv(v_cache, tables)[:, :, :ctx_len]
        q_s = q[starts[i] : starts[i + 1]].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if n == ctx_len and sliding_window is None and sinks is None and attention_chunk is None:
            # no cached prefix: plain causal (lets SDPA pick a fused kernel)
            o = F.scaled_dot_product_attention(q_s, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            q_pos = torch.arange(ctx_len - n, ctx_len, device=q.device)[:, None]  # [n, 1]
            k_pos = torch.arange(ctx_len, device=q.device)[None, :]  # [1, L]
            visible = k_pos <= q_pos  # [n, L]
            if sliding_window is not None:
                visible &= k_pos > q_pos - sliding_window
            if attention_chunk is not None:
                visible &= k_pos >= q_pos // attention_chunk * attention_chunk
            o = dense_attention(q_s, k, v, scale, visible, sinks)
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1)
    return out


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr,
                       sinks_ptr, qk_scale_log2, window, chunk,
                       stride_qt, stride_qh, stride_ot, stride_oh,
                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                       block_size, head_dim,
                       GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                       HAS_CHUNK: tl.constexpr):
        """One program per (request, query head, BLOCK_M query rows); online softmax over
        BLOCK_N-position tiles gathered through the block table, from the tile's window start."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        q_block = tl.program_id(2)
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        if q_block * BLOCK_M >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len
        kv_head = head // GROUP
        offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_valid = offs_m < q_len
        d_valid = offs_d < head_dim
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=m_valid[:, None] & d_valid[None, :], other=0.0)
        q_pos = first_pos + offs_m  # [BLOCK_M]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = tl.minimum(seq_len, first_pos + (q_block + 1) * BLOCK_M)
        kv_start = 0
        if HAS_WINDOW:  # the tile's first row sees nothing before its window
            kv_start = tl.maximum(first_pos + q_block * BLOCK_M - window + 1, 0)
        if HAS_CHUNK:  # ... nor before its chunk
            kv_start = tl.maximum(kv_start, (first_pos + q_block * BLOCK_M) // chunk * chunk)
        table = bt_ptr + seq.to(tl.int64) * stride_bt
        for start in range(kv_start, kv_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < kv_end
            blk = tl.load(table + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
            slot = (offs_n % block_size).to(tl.int64)
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(k_cache_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ks
                        + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs
                        + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
            causal = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
            if HAS_WINDOW:
                causal = causal & (offs_n[None, :] > q_pos[:, None] - window)
            if HAS_CHUNK:
                causal = causal & (offs_n[None, :] >= q_pos[:, None] // chunk * chunk)
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row may see nothing in this tile yet (windows): keep exp2 away from -inf - -inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if HAS_SINKS:  # the sink's e^sink joins the denominator (log2 domain, relative to m_i)
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
            l_i = l_i + tl.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])

    return SimpleNamespace(triton=triton, prefill=prefill_kernel)


_PREFILL_CONFIGS = (
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
)
_INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16}


def check_paged_inputs(q, k_cache, v_cache, cu_query_lens, seq_lens, block_tables) -> None:
    """Assert the shapes, dtypes and layout that the paged kernels rely on."""
    assert q.dim() == 3, f"q must be [T, H, D], got {tuple(q.shape)}"
    num_heads, head_dim = q.shape[1:]
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be [NB, B, KVH, D]"
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != {head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads}"
    assert k_cache.dtype == v_cache.dtype == q.dtype, "q and caches must share a dtype"
    num_seqs = seq_lens.shape[0]
    assert cu_query_lens.shape == (num_seqs + 1,) and cu_query_lens.dtype == torch.int32
    assert seq_lens.dtype == torch.int32 and block_tables.dtype == torch.int32
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert cu_query_lens.is_contiguous() and seq_lens.is_contiguous()
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    check_same_device(q, k_cache, v_cache, cu_query_lens, seq_lens, block_tables)


def check_variants(q: torch.Tensor, sliding_window: int | None, sinks: torch.Tensor | None) -> None:
    """Assert the window is a positive int and sinks are [H] contiguous float32 on q's device."""
    assert sliding_window is None or sliding_window >= 1, f"sliding_window {sliding_window}"
    if sinks is not None:
        assert sinks.shape == (q.shape[1],), f"sinks {tuple(sinks.shape)} for {q.shape[1]} heads"
        assert sinks.dtype == torch.float32 and sinks.is_contiguous(), ("sinks must be contiguous "
                                                                        "fp32")
        assert sinks.device == q.device, f"sinks on {sinks.device}, q on {q.device}"


def paged_prefill_triton(q, k_cache, v_cache, cu_query_lens, seq_lens, block_tables, scale,
                         max_query_len: int, out: torch.Tensor, sliding_window: int | None = None,
                         sinks: torch.Tensor | None = None,
                         attention_chunk: int | None = None) -> torch.Tensor:
    """The mixed-batch kernel (any query lengths). Inputs already checked."""
    kern = _kernels()
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1:]
    group = num_heads // k_cache.shape[2]
    log2e = 1.4426950408889634

    def launch(cfg):
        meta, opts = split_launch_options(cfg)
        grid = (num_seqs, num_heads, kern.triton.cdiv(max_query_len, meta["BLOCK_M"]))
        kern.prefill[grid](
            q, k_cache, v_cache, out, cu_query_lens, seq_lens, block_tables,
            sinks if sinks is not None else seq_lens, scale * log2e, sliding_window or 0,
            attention_chunk or 1, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
            k_cache.shape[1], head_dim,
            GROUP=group, BLOCK_D=kern.triton.next_power_of_2(head_dim),
            HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
            HAS_CHUNK=attention_chunk is not None, **meta, **opts,
        )

    if q.is_cuda:
        bucket = (num_heads, group, head_dim, str(q.dtype), min(max_query_len, 4096).bit_length())
        cfg = pick_config("paged_prefill", bucket, _PREFILL_CONFIGS, launch, q.device)
    else:
        cfg = _INTERPRETER_CONFIG
    launch(cfg)
    return out


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_decode_seqs: int | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Same contract as `paged_attention_reference`.

    Pass `max_query_len` / `max_seq_len` (host ints the scheduler already knows) to avoid a device
    sync. Decode-only batches (max_query_len == 1) use the split-KV kernel; `num_splits` overrides
    its split rule (tests). `num_decode_seqs`: when the first that many requests are decodes
    (query_len 1, the engine's order), they go to the decode kernel and only the rest to the
    prefill kernel, whose 16-128-row query tiles would mostly idle on one-token requests.
    """
    check_paged_inputs(q, k_cache, v_cache, cu_query_lens, seq_lens, block_tables)
    check_variants(q, sliding_window, sinks)
    assert attention_chunk is None or attention_chunk >= 1, f"attention_chunk {attention_chunk}"
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    num_seqs = seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max().item())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    if max_query_len == 1:
        num_decode_seqs = num_seqs
    num_decode_seqs = num_decode_seqs or 0
    assert 0 <= num_decode_seqs <= num_seqs, f"num_decode_seqs {num_decode_seqs} of {num_seqs}"
    if num_decode_seqs:
        # cu_query_lens holds absolute q rows: decode request i owns q row i
        paged_decode_triton(q[:num_decode_seqs], k_cache, v_cache, seq_lens[:num_decode_seqs],
                            block_tables[:num_decode_seqs], scale, max_seq_len=max_seq_len,
                            out=out[:num_decode_seqs], num_splits=num_splits,
                            sliding_window=sliding_window, sinks=sinks,
                            attention_chunk=attention_chunk)
    if num_decode_seqs < num_seqs:
        paged_prefill_triton(q, k_cache, v_cache, cu_query_lens[num_decode_seqs:],
                             seq_lens[num_decode_seqs:], block_tables[num_decode_seqs:], scale,
                             max_query_len, out, sliding_window, sinks, attention_chunk)
    return out
