"""TritonPagedAttention: the CUDA attention backend, over the Triton kernels of engine/kernels.

Dimension legend: T tokens in the step, H query heads, G kv heads, Dh head dim, S sequences.

Per layer: `store_kv` writes the step's k/v [T, G, Dh] into the paged caches at `slot_mapping`, then
one `paged_attention` call covers the whole mixed batch from the metadata's per-sequence tensors
(cu_query_lens [S+1], seq_lens [S], block_tables [S, max_blocks]; decode sequences first). Cascade
groups are not needed here: the per-sequence tensors already cover every decode row. Windows, chunks
(Llama 4) and sinks go to the kernels as they are (block-table entries before a window are never
read, so a window group's table may hold block 0 there).

The kernels want host ints for the longest query and context (no device sync per layer); they are
read off the shapes of the metadata's CPU-built tensors, which the runner sizes by exactly those
lengths.
"""

from __future__ import annotations

import torch

from engine import kernels
from engine.layers.attention import AttentionMetadata, PagedAttentionBackend


class TritonPagedAttention(PagedAttentionBackend):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float, meta: AttentionMetadata, *,
                sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                attention_chunk: int | None = None) -> torch.Tensor:
        if meta.cu_query_lens is None or meta.seq_lens is None or meta.block_tables is None:
            raise ValueError("TritonPagedAttention needs cu_query_lens, seq_lens and block_tables")
        kernels.store_kv(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache,
                         meta.slot_mapping)
        max_query_len, max_seq_len = max_lens(meta)
        return kernels.paged_attention(
            q.to(k_cache.dtype), k_cache, v_cache, meta.cu_query_lens, meta.seq_lens,
            meta.block_tables, scale, max_query_len=max_query_len, max_seq_len=max_seq_len,
            num_decode_seqs=meta.num_decode_tokens,  # one row per decode sequence
            sliding_window=sliding_window, attention_chunk=attention_chunk,
            sinks=sinks.float().contiguous() if sinks is not None else None,
        ).to(q.dtype)


def max_lens(meta: AttentionMetadata) -> tuple[int, int]:
    """(longest query, longest context) in tokens over the step's sequences, from host-side ints."""
    return meta.max_query_len, meta.max_seq_len