"""Hidden states -> sentence vectors, as sentence-transformers' Pooling and Normalize modules do.

    pool(hidden [N, C] packed, lengths [B], "mean" | "cls") -> [B, C]
    normalize(vectors [B, C]) -> [B, C] of unit L2 norm
    shorten(vectors [N, C], d, renormalize) -> [N, d]: OpenAI's `dimensions`
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.embedding.config import Pooling


def pool(hidden: torch.Tensor, lengths: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """Mean over each input's tokens, or its first ([CLS]) token's state; `hidden` holds the
    inputs' tokens end to end (`lengths` each)."""
    starts = torch.cumsum(lengths, 0) - lengths
    if pooling == "cls":
        return hidden[starts]
    rows = torch.repeat_interleave(torch.arange(lengths.shape[0], device=hidden.device), lengths)
    summed = hidden.new_zeros(lengths.shape[0], hidden.shape[1]).index_add_(0, rows, hidden)
    return summed / lengths[:, None].to(hidden.dtype)


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    return F.normalize(vectors, p=2.0, dim=-1)


def shorten(vectors: np.ndarray, num_dimensions: int, renormalize: bool) -> np.ndarray:
    """The first `num_dimensions` of each vector, scaled back to unit length when the model's
    vectors are normalized (OpenAI's text-embedding-3 `dimensions`); float32 [N, d]."""
    short = np.ascontiguousarray(vectors[:, :num_dimensions], dtype=np.float32)
    if renormalize:
        norms = np.linalg.norm(short, axis=1, keepdims=True)
        short /= np.maximum(norms, np.float32(1e-12))
    return short
