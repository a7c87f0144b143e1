"""RMSNorm (Hugging Face semantics: normalise in float32, scale in the input dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rms_norm_fast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One fused op for float32 activations (same math as `rms_norm`); falls back otherwise."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return rms_norm(x, weight, eps)
