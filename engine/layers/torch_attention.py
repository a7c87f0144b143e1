"""TorchPagedAttention: paged attention for mixed prefill + decode batches in PyTorch (the CPU path).

Dimension legend: T tokens in the step, H query heads, G kv heads, R = H / G queries per kv head,
Dh head dim, D plain decode rows, L their longest context, n rows of a cascade group, P its shared
prefix length, S its longest suffix, C a prefill chunk's context.

Decode rows of sequences that share a long prompt prefix (agent loops: one system prompt and tool
schema for every session) go through cascade attention: the prefix K/V is gathered once for the whole
group instead of once per sequence, which is most of the memory traffic of a decode step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.layers.attention import AttentionMetadata, CascadeGroup, PagedAttentionBackend


class TorchPagedAttention(PagedAttentionBackend):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float, meta: AttentionMetadata) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        num_plain = meta.decode_blocks.shape[0] if meta.decode_blocks is not None else 0
        if num_plain and num_plain == q.shape[0]:
            return _plain_decode(q, k_cache, v_cache, meta, scale)  # the common decode-only step
        out = torch.empty_like(q)
        if num_plain:
            out[:num_plain] = _plain_decode(q[:num_plain], k_cache, v_cache, meta, scale)
        for group in meta.cascade_groups:
            rows = slice(group.row_start, group.row_end)
            out[rows] = _cascade_decode(q[rows], k_cache, v_cache, group, scale)
        for seg in meta.prefills:
            # 4-D [1, heads, len, Dh] inputs: with 3-D ones SDPA leaves its fused CPU kernel for the
            # ~5x slower math path.
            qs = q[seg.query_start:seg.query_end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, Dh]
            ks = _gather(k_cache, seg.context_blocks, seg.context_len).transpose(0, 1).unsqueeze(0)
            vs = _gather(v_cache, seg.context_blocks, seg.context_len).transpose(0, 1).unsqueeze(0)
            q_len, context_len = qs.shape[2], seg.context_len
            mask = causal_lower_right(q_len, context_len) if seg.num_cached_tokens else None
            os_ = F.scaled_dot_product_attention(qs, ks.to(q.dtype), vs.to(q.dtype), attn_mask=mask,
                                                 is_causal=mask is None, scale=scale, enable_gqa=True)
            out[seg.query_start:seg.query_end] = os_[0].transpose(0, 1)  # [H, q_len, Dh] -> [q_len, H, Dh]
        return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, num_positions: int) -> torch.Tensor:
    """Whole blocks of the cache -> their first `num_positions` positions.

    cache [num_blocks, bs, G, Dh], blocks [..., W] -> [..., num_positions, G, Dh]. Copying whole blocks
    (contiguous runs of bs * G * Dh values) is much cheaper than gathering slot by slot.
    """
    gathered = cache[blocks]  # [..., W, bs, G, Dh]
    flat = gathered.flatten(-4, -3)  # [..., W * bs, G, Dh]
    return flat[..., :num_positions, :, :]


def _plain_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
    assert meta.decode_blocks is not None
    qd = q.unsqueeze(2)  # [D, H, 1, Dh]
    kd = _gather(k_cache, meta.decode_blocks, meta.decode_len).transpose(1, 2).to(q.dtype)  # [D, G, L, Dh]
    vd = _gather(v_cache, meta.decode_blocks, meta.decode_len).transpose(1, 2).to(q.dtype)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                        enable_gqa=True)
    return od.squeeze(2)  # [D, H, 1, Dh] -> [D, H, Dh]


def _cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    group: CascadeGroup, scale: float) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    r = num_heads // num_kv_heads
    prefix_len = group.prefix_blocks.shape[0] * k_cache.shape[1]
    # Shared prefix: every row's queries against one copy of the prefix.
    qp = q.view(n, num_kv_heads, r, head_dim).permute(1, 0, 2, 3).reshape(1, num_kv_heads, n * r, head_dim)
    kp = _gather(k_cache, group.prefix_blocks, prefix_len).transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, G, P, Dh]
    vp = _gather(v_cache, group.prefix_blocks, prefix_len).transpose(0, 1).unsqueeze(0).to(q.dtype)
    out_p, lse_p = _attention_with_lse(qp, kp, vp, scale, None)  # [1, G, n*R, Dh], [1, G, n*R, 1]
    out_p = out_p.view(num_kv_heads, n, r, head_dim).permute(1, 0, 2, 3)  # -> [n, G, R, Dh]
    lse_p = lse_p.view(num_kv_heads, n, r, 1).permute(1, 0, 2, 3)
    # Each row's own suffix.
    qs = q.view(n, num_kv_heads, r, head_dim)  # [n, G, R, Dh]
    ks = _gather(k_cache, group.suffix_blocks, group.suffix_len).transpose(1, 2).to(q.dtype)  # [n, G, S, Dh]
    vs = _gather(v_cache, group.suffix_blocks, group.suffix_len).transpose(1, 2).to(q.dtype)
    out_s, lse_s = _attention_with_lse(qs, ks, vs, scale, group.suffix_mask)  # [n, G, R, Dh]
    # Merge the two partial softmaxes.
    lse = torch.logaddexp(lse_p, lse_s)
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
