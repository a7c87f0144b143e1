"""Rotary position embedding, Hugging Face llama style (rotate_half over the two halves of Dh)."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict[str, object] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            inv_freq = _llama3_scaled(inv_freq, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, Dh]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, 1, Dh]: looked up once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh] (q and k heads side by side is fine) -> rotated copy."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, object]) -> torch.Tensor:
    import math

    factor = float(scaling["factor"])  # type: ignore[arg-type]
    low = float(scaling.get("low_freq_factor", 1.0))  # type: ignore[arg-type]
    high = float(scaling.get("high_freq_factor", 4.0))  # type: ignore[arg-type]
    old_len = float(scaling.get("original_max_position_embeddings", 8192))  # type: ignore[arg-type]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)
