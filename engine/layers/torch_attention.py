"""TorchPagedAttention: paged attention for mixed prefill + decode batches in PyTorch (the CPU
path).

Dimension legend: T tokens in the step, H query heads, G kv heads, R = H / G queries per kv head,
Dh head dim, D plain decode rows, L their longest context, n rows of a cascade group, P its shared
prefix length, S its longest suffix, C a prefill chunk's context.

Decode rows of sequences that share a long prompt prefix (agent loops: one system prompt and tool
schema for every session) go through cascade attention: the prefix K/V is gathered once for the
whole group instead of once per sequence, which is most of the memory traffic of a decode step.

Sliding windows and sinks (engine/layers/attention.py): masks are built from absolute positions, so
a window layer stays correct whether its metadata holds the whole context or only the window's
blocks. Chunked local attention (Llama 4) masks the same way. A window or chunked layer's cascade
rows are attended row by row (a shared prefix mostly lies outside the window). Sinks go through
`dense_attention` (SDPA has no sink term); a cascade merge adds them to the merged log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.paged_attention import dense_attention
from engine.layers.attention import (
    AttentionMetadata,
    CascadeGroup,
    PagedAttentionBackend,
    PrefillSegment,
)


class TorchPagedAttention(PagedAttentionBackend):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float, meta: AttentionMetadata, *,
                sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                attention_chunk: int | None = None) -> torch.Tensor:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if attention_chunk is not None and attention_chunk < 1:
            raise ValueError(f"attention_chunk must be >= 1, got {attention_chunk}")
        local = _Local(sliding_window, attention_chunk)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping,
                                                             k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping,
                                                             v.to(v_cache.dtype))
        num_plain = meta.decode_blocks.shape[0] if meta.decode_blocks is not None else 0
        if num_plain and num_plain == q.shape[0]:  # the common decode-only step
            return _plain_decode(q, k_cache, v_cache, meta, scale, local, sinks)
        out = torch.empty_like(q)
        if num_plain:
            out[:num_plain] = _plain_decode(q[:num_plain], k_cache, v_cache, meta, scale, local,
                                            sinks)
        for group in meta.cascade_groups:
            rows = slice(group.row_start, group.row_end)
            if local.is_global:
                out[rows] = _cascade_decode(q[rows], k_cache, v_cache, group, scale, sinks)
            else:
                out[rows] = _windowed_cascade_rows(q[rows], k_cache, v_cache, group, meta, scale,
                                                   local, sinks)
        for seg in meta.prefills:
            rows = slice(seg.query_start, seg.query_end)
            out[rows] = _prefill(q[rows], k_cache, v_cache, seg, scale, local, sinks)
        return out


@dataclass(frozen=True)
class _Local:
    """What a query at position p may see besides the causal limit: keys after p - window (a
    sliding window) and keys from floor(p / chunk) * chunk on (chunked local attention)."""

    window: int | None
    chunk: int | None

    @property
    def is_global(self) -> bool:
        return self.window is None and self.chunk is None

    def visible(self, k_pos: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Broadcast key and query positions -> whether each key is seen (causality included)."""
        seen = k_pos <= q_pos
        if self.window is not None:
            seen &= k_pos > q_pos - self.window
        if self.chunk is not None:
            seen &= k_pos >= torch.div(q_pos, self.chunk, rounding_mode="floor") * self.chunk
        return seen


def _gather(cache: torch.Tensor, blocks: torch.Tensor, num_positions: int) -> torch.Tensor:
    """Whole blocks of the cache -> their first `num_positions` positions.

    cache [num_blocks, bs, G, Dh], blocks [..., W] -> [..., num_positions, G, Dh]. Copying whole
    blocks (contiguous runs of bs * G * Dh values) is much cheaper than gathering slot by slot.
    """
    gathered = cache[blocks]  # [..., W, bs, G, Dh]
    flat = gathered.flatten(-4, -3)  # [..., W * bs, G, Dh]
    return flat[..., :num_positions, :, :]


def _lower_right_causal(q_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """The causal mask of a chunk that ends the context: query i (at position context_len - q_len +
    i) sees the keys up to its own position. On the CPU the [q_len, context_len] boolean mask
    torch.nn.attention.bias.causal_lower_right materializes there anyway; that module is imported
    only on other devices (where SDPA dispatches its bias to fused kernels): it imports
    torch._dynamo, seconds of every replica process's start-up."""
    if device.type == "cpu":
        return torch.ones(q_len, context_len, dtype=torch.bool, device=device).tril(
            context_len - q_len)
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(q_len, context_len)


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: PrefillSegment,
             scale: float, local: _Local, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [q_len, H, Dh] of one chunk -> [q_len, H, Dh]."""
    # 4-D [1, heads, len, Dh] inputs: with 3-D ones SDPA leaves its fused CPU kernel for the
    # ~5x slower math path.
    num_positions = seg.context_len - seg.context_start
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, Dh]
    ks = _gather(k_cache, seg.context_blocks, num_positions).transpose(0,
                                                                       1).unsqueeze(0).to(q.dtype)
    vs = _gather(v_cache, seg.context_blocks, num_positions).transpose(0,
                                                                       1).unsqueeze(0).to(q.dtype)
    q_len = qs.shape[2]
    if local.is_global and sinks is None and seg.context_start == 0:
        mask = (_lower_right_causal(q_len, seg.context_len, q.device)
                if seg.num_cached_tokens else None)
        os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                             scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(seg.num_cached_tokens, seg.context_len, device=q.device)  # [q_len]
        k_pos = torch.arange(seg.context_start, seg.context_len, device=q.device)  # [C']
        visible = local.visible(k_pos[None, :], q_pos[:, None])  # [q_len, C']
        os_ = dense_attention(qs, ks, vs, scale, visible, sinks)
    return os_[0].transpose(0, 1)  # [H, q_len, Dh] -> [q_len, H, Dh]


def _plain_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, local: _Local,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    assert meta.decode_blocks is not None
    if local.is_global and sinks is None and meta.decode_first_positions is None:
        qd = q.unsqueeze(2)  # [D, H, 1, Dh]
        # [D, G, L, Dh]
        kd = _gather(k_cache, meta.decode_blocks, meta.decode_len).transpose(1, 2).to(q.dtype)
        vd = _gather(v_cache, meta.decode_blocks, meta.decode_len).transpose(1, 2).to(q.dtype)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                            enable_gqa=True)
        return od.squeeze(2)  # [D, H, 1, Dh] -> [D, H, Dh]
    if meta.decode_context_lens is None:
        raise ValueError("windowed or sink decode rows need AttentionMetadata.decode_context_lens")
    return _decode_rows(q, k_cache, v_cache, meta.decode_blocks, meta.decode_len,
                        meta.decode_context_lens, meta.decode_first_positions, scale, local, sinks)


def _decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 blocks: torch.Tensor, num_positions: int, context_lens: torch.Tensor,
                 first_positions: torch.Tensor | None,
                 scale: float, local: _Local, sinks: torch.Tensor | None) -> torch.Tensor:
    """One query per row at position context_len - 1: q [n, H, Dh], blocks [n, W] (row i's first
    block starts at first_positions[i]) -> [n, H, Dh]; positions outside the row's context or window
    are masked."""
    kd = _gather(k_cache, blocks, num_positions).transpose(1, 2).to(q.dtype)  # [n, G, L, Dh]
    vd = _gather(v_cache, blocks, num_positions).transpose(1, 2).to(q.dtype)
    ctx = context_lens.to(device=q.device, dtype=torch.int64)[:, None]  # [n, 1]
    pos = torch.arange(num_positions, device=q.device)[None, :]  # [1, L]
    if first_positions is not None:
        pos = pos + first_positions.to(device=q.device, dtype=torch.int64)[:, None]  # [n, L]
    visible = local.visible(pos, ctx - 1)  # [n, L]: the query sits at ctx - 1
    # [n, H, 1, Dh]
    od = dense_attention(q.unsqueeze(2), kd, vd, scale, visible[:, None, None, :], sinks)
    return od.squeeze(2)


def _windowed_cascade_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           group: CascadeGroup, meta: AttentionMetadata, scale: float,
                           local: _Local, sinks: torch.Tensor | None) -> torch.Tensor:
    """A cascade group's rows on a window or chunked layer: each row's prefix + suffix as one
    table."""
    if meta.seq_lens is None:
        raise ValueError("windowed cascade rows need AttentionMetadata.seq_lens")
    n = q.shape[0]
    prefix_len = group.prefix_blocks.shape[0] * k_cache.shape[1]
    # [n, P/bs + W]
    tables = torch.cat([group.prefix_blocks.expand(n, -1), group.suffix_blocks], dim=1)
    # decode rows come first, in row order
    context_lens = meta.seq_lens[group.row_start:group.row_end]
    return _decode_rows(q, k_cache, v_cache, tables, prefix_len + group.suffix_len, context_lens,
                        None, scale, local, sinks)


def _cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    group: CascadeGroup, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    r = num_heads // num_kv_heads
    prefix_len = group.prefix_blocks.shape[0] * k_cache.shape[1]
    # Shared prefix: every row's queries against one copy of the prefix.
    qp = q.view(n, num_kv_heads, r, head_dim).permute(1, 0, 2, 3).reshape(1, num_kv_heads, n * r,
                                                                          head_dim)
    # [1, G, P, Dh]
    kp = _gather(k_cache, group.prefix_blocks, prefix_len).transpose(0, 1).unsqueeze(0).to(q.dtype)
    vp = _gather(v_cache, group.prefix_blocks, prefix_len).transpose(0, 1).unsqueeze(0).to(q.dtype)
    out_p, lse_p = _attention_with_lse(qp, kp, vp, scale, None)  # [1, G, n*R, Dh], [1, G, n*R, 1]
    out_p = out_p.view(num_kv_heads, n, r, head_dim).permute(1, 0, 2, 3)  # -> [n, G, R, Dh]
    lse_p = lse_p.view(num_kv_heads, n, r, 1).permute(1, 0, 2, 3)
    # Each row's own suffix.
    qs = q.view(n, num_kv_heads, r, head_dim)  # [n, G, R, Dh]
    # [n, G, S, Dh]
    ks = _gather(k_cache, group.suffix_blocks, group.suffix_len).transpose(1, 2).to(q.dtype)
    vs = _gather(v_cache, group.suffix_blocks, group.suffix_len).transpose(1, 2).to(q.dtype)
    out_s, lse_s = _attention_with_lse(qs, ks, vs, scale, group.suffix_mask)  # [n, G, R, Dh]
    # Merge the two partial softmaxes (and the sink's term, which has no value).
    lse = torch.logaddexp(lse_p, lse_s)
    if sinks is not None:
        # head = g * R + r
        lse = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, num_kv_heads, r, 1))
    out = out_p * torch.exp(lse_p - lse) + out_s * torch.exp(lse_s - lse)
    return out.reshape(n, num_heads, head_dim)  # [n, G, R, Dh] -> [n, H, Dh]


def _attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, G, M, Dh], k/v [B, G, N, Dh], additive mask broadcastable to [B, G, M, N]
    -> (out [B, G, M, Dh], log-sum-exp [B, G, M, 1])."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, G, M, N]
    if mask is not None:
        scores = scores + mask.to(scores.dtype)
    peak = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v) / total, peak + torch.log(total)
