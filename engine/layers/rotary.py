"""Rotary position embedding, Hugging Face llama style (rotate_half over the two halves of Dh).

Scalings (`scaling["rope_type"]`): "linear" (positions divided by `factor`: Gemma 3's global
layers), "llama3" (Llama 3.1 wavelength bands), "freq_factors" (llama.cpp's `rope_freqs` tensor, as
a GGUF stores llama3 scaling: each frequency divided by its factor) and "yarn" (gpt-oss,
transformers' `_compute_yarn_parameters`: a ramp between interpolated and extrapolated frequencies
over the correction range of `beta_fast` / `beta_slow`, and cos/sin multiplied by the attention
factor, 0.1 ln(factor) + 1 unless the config states `attention_factor`). Other types are refused.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict[str, object] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        inv_freq = (1.0
                    / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                / head_dim)))
        rope_type = scaling.get("rope_type", scaling.get("type")) if scaling else None
        attention_factor = 1.0
        if rope_type == "linear":  # position interpolation (Gemma 3's global layers): p / factor
            inv_freq = inv_freq / float(scaling["factor"])  # type: ignore[index, arg-type]
        elif rope_type == "llama3":
            inv_freq = _llama3_scaled(inv_freq, scaling)  # type: ignore[arg-type]
        elif rope_type == "freq_factors":  # a GGUF's rope_freqs: theta_i / factor_i
            factors = torch.tensor(scaling["factors"], dtype=torch.float32)  # type: ignore[index, arg-type]
            if factors.shape != inv_freq.shape:
                raise ValueError(f"rope freq factors: {factors.shape[0]} for {inv_freq.shape[0]} "
                                 "frequencies")
            inv_freq = inv_freq / factors
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_scaled(head_dim, base, scaling)  # type: ignore[arg-type]
        elif rope_type not in (None, "default"):
            raise NotImplementedError(f"rope scaling {rope_type!r} is not supported (linear, "
                                      "llama3, freq_factors, yarn)")
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, Dh]
        self.cos = (emb.cos() * attention_factor).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention_factor).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, 1, Dh]: looked up once per step, shared by every
        layer."""
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


def _yarn_scaled(head_dim: int, base: float,
                 scaling: dict[str, object]) -> tuple[torch.Tensor, float]:
    """(inv_freq [Dh/2], attention factor): transformers' `_compute_yarn_parameters`, step for
    step."""
    import math

    factor = float(scaling["factor"])  # type: ignore[arg-type]
    original = float(scaling["original_max_position_embeddings"])  # type: ignore[arg-type]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (get_mscale(factor, float(mscale))  # type: ignore[arg-type]
                            / get_mscale(factor, float(mscale_all_dim))  # type: ignore[arg-type]
                            if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast = float(scaling.get("beta_fast") or 32)  # type: ignore[arg-type]
    beta_slow = float(scaling.get("beta_slow") or 1)  # type: ignore[arg-type]

    def correction_dim(num_rotations: float) -> float:
        return ((head_dim * math.log(original / (num_rotations * 2 * math.pi)))
                / (2 * math.log(base)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp  # [Dh/2]: 1 where the frequency is kept, 0 where it is interpolated
    inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
                + (1.0 / pos_freqs) * extrapolation)
    return inv_freq, float(attention_factor)  # type: ignore[arg-type]
