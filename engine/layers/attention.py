"""Paged attention for mixed prefill + decode batches, and the per-step attention context.

Dimension legend: T tokens in the step, H query heads, G kv heads (grouped-query), Dh head dim,
D decode sequences (one new token each), L longest decode context, C a prefill sequence's context.

The runner builds one `AttentionMetadata` per step and enters `forward_context(metadata)`; attention layers
read it with `current_metadata()`. Nesting is rejected, so a stale context can never leak into a step.
Token order inside a step: the D decode tokens first, then each prefill chunk's tokens.

Backends (rule: swappable behind an ABC): `TorchPagedAttention` (CPU, and the reference) and, on CUDA,
the Triton kernels of engine/kernels (selected by `engine.kernels.kernel_backend()`).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSegment:
    query_start: int  # rows [query_start, query_end) of the step's tokens
    query_end: int
    context_slots: torch.Tensor  # [C] int64 slots of the whole context (cached prefix + this chunk)
    mask: torch.Tensor | None  # [q_len, C] bool (True = attend); None = plain causal (no prefix)


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes (block_id * block_size + offset)
    num_decode_tokens: int
    decode_slots: torch.Tensor | None  # [D, L] int64 context slots, padded with slot 0
    decode_mask: torch.Tensor | None  # [D, 1, 1, L] bool, False on padding
    prefills: tuple[PrefillSegment, ...]
    # Raw per-sequence tensors for kernel backends (Triton): decode seqs first, then prefill seqs.
    cu_query_lens: torch.Tensor | None = None  # [S+1] int32
    seq_lens: torch.Tensor | None = None  # [S] int32
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int32


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context does not nest: a step is already running")
    _current = metadata
    try:
        yield
    finally:
        _current = None


def current_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention called outside forward_context")
    return _current


class PagedAttentionBackend(abc.ABC):
    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, Dh], k/v [T, G, Dh] (new tokens) -> [T, H, Dh]. Writes k/v into the caches
        ([num_blocks, block_size, G, Dh]) at meta.slot_mapping first, then attends over each context."""


class TorchPagedAttention(PagedAttentionBackend):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float, meta: AttentionMetadata) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, G, Dh]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        num_decode = meta.num_decode_tokens
        out = torch.empty_like(q) if meta.prefills else None
        if num_decode:
            assert meta.decode_slots is not None
            qd = q[:num_decode].unsqueeze(2)  # [D, H, 1, Dh]
            kd = k_flat[meta.decode_slots].transpose(1, 2)  # [D, L, G, Dh] -> [D, G, L, Dh]
            vd = v_flat[meta.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd.to(q.dtype), vd.to(q.dtype),
                                                attn_mask=meta.decode_mask, scale=scale,
                                                enable_gqa=True)
            if out is None:
                return od.squeeze(2)  # [D, H, 1, Dh] -> [D, H, Dh]
            out[:num_decode] = od.squeeze(2)
        for seg in meta.prefills:
            qs = q[seg.query_start:seg.query_end].transpose(0, 1)  # [q_len, H, Dh] -> [H, q_len, Dh]
            ks = k_flat[seg.context_slots].transpose(0, 1).to(q.dtype)  # [C, G, Dh] -> [G, C, Dh]
            vs = v_flat[seg.context_slots].transpose(0, 1).to(q.dtype)
            os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask,
                                                 is_causal=seg.mask is None, scale=scale,
                                                 enable_gqa=True)
            out[seg.query_start:seg.query_end] = os_.transpose(0, 1)  # [H, q_len, Dh] -> [q_len, H, Dh]
        assert out is not None
        return out


def build_attention_backend(name: str) -> PagedAttentionBackend:
    if name == "torch":
        return TorchPagedAttention()
    if name == "triton":
        from engine.layers.triton_attention import TritonPagedAttention

        return TritonPagedAttention()
    raise ValueError(f"unknown attention backend {name!r}")
