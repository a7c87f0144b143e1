"""MXFP4 weights (OCP microscaling FP4, as the released gpt-oss checkpoints store their experts).

Dimension legend: N output rows, K inputs, G = K / 32 groups of a row, E experts.

    blocks  uint8 [..., N, G, 16]  two e2m1 values a byte: value 2j in the low nibble, 2j + 1 in the
                                   high
    scales  uint8 [..., N, G]      e8m0: the group's power of two, biased by 127
    weight  [..., N, K]            weight[n, 32 g + i] = e2m1(nibble i of group g) * 2 ** (scales[n,
                                   g] - 127)

This is the file layout transformers' `integrations/mxfp4.py::convert_moe_packed_tensors` reads; it
returns the same values transposed to its [E, K, N] parameter layout, the engine keeps [E, N, K]
(rows are outputs, like every other weight it holds). e2m1 codes: sign bit 3, then
{0, 0.5, 1, 1.5, 2, 3, 4, 6}; every dequantized value is exact in float32 and bfloat16 alike.

`quantize_mxfp4` is the inverse up to rounding (round to the nearest e2m1 value under the smallest
power-of-two scale that keeps the group's largest magnitude <= 6): tests use it to write checkpoints
laid out like the released ones.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

GROUP_SIZE = 32  # values per scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
               -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., N, G, 16], scales uint8 [..., N, G] -> weight [..., N, G * 32] in
    `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                        f"{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP_SIZE // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)}")
    # one gather of (low, high) value pairs per byte: ~5x faster on the CPU than indexing each
    # nibble
    pairs = _byte_values(dtype, blocks.device).index_select(0, blocks.flatten().int())  # [bytes, 2]
    values = pairs.view(*scales.shape, GROUP_SIZE)  # [..., N, G, 32]: low nibble first
    ones = torch.ones(scales.shape, dtype=dtype, device=scales.device)
    values *= torch.ldexp(ones, scales.int() - SCALE_BIAS).unsqueeze(-1)  # exact: powers of two
    return values.flatten(-2)  # [..., N, G * 32]


@functools.lru_cache(maxsize=8)
def _byte_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: byte b -> (e2m1(b & 15), e2m1(b >> 4))."""
    lut = torch.tensor(E2M1_VALUES, dtype=dtype)
    return torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=-1).to(device)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] (K a multiple of 32) -> (blocks uint8 [..., N, K/32, 16], scales uint8
    [..., N, K/32])."""
    if weight.shape[-1] % GROUP_SIZE:
        raise ValueError(f"MXFP4 needs the input size to be a multiple of {GROUP_SIZE}, got "
                         f"{weight.shape[-1]}")
    groups = weight.float().unflatten(-1, (-1, GROUP_SIZE))  # [..., N, G, 32]
    amax = groups.abs().amax(dim=-1, keepdim=True)  # [..., N, G, 1]
    # smallest e with amax / 2^e <= 6 (e2m1's largest magnitude)
    exponent = torch.ceil(torch.log2(amax.clamp(min=2.0 ** -126)
                                     / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponent)  # [..., N, G, 32] in [-6, 6]
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=weight.device)  # [8]
    # [..., N, G, 32] in 0..7
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = codes + 8 * (scaled < 0)  # sign bit
    codes = codes.to(torch.uint8).unflatten(-1, (GROUP_SIZE // 2, 2))  # [..., N, G, 16, 2]
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    scales = (exponent.squeeze(-1) + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


@dataclass(frozen=True)
class MXFP4Weight:
    """A stack of MXFP4 matrices: blocks [E, N, G, 16] and scales [E, N, G] (uint8, as stored)."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.blocks.dim() != 4 or self.blocks.shape[:-1] != self.scales.shape:
            raise ValueError(f"MXFP4 blocks {tuple(self.blocks.shape)} and scales "
                             f"{tuple(self.scales.shape)} are not [E, N, G, 16] and [E, N, G]")

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dequantized [E, N, K]."""
        num_experts, rows, groups, _ = self.blocks.shape
        return num_experts, rows, groups * GROUP_SIZE

    def dequantize(self, dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
        """-> [E', N, K] in `dtype`: every matrix, or only `experts` [E'] (int64 ids)."""
        if experts is None:
            return dequantize_mxfp4(self.blocks, self.scales, dtype)
        return dequantize_mxfp4(self.blocks[experts], self.scales[experts], dtype)

    def select_rows(self, rows: torch.Tensor) -> MXFP4Weight:
        """The same matrices with their output rows reordered by `rows` [N'] (int64)."""
        return MXFP4Weight(self.blocks[:, rows].contiguous(), self.scales[:, rows].contiguous())

    def to(self, device: torch.device) -> MXFP4Weight:
        return MXFP4Weight(self.blocks.to(device), self.scales.to(device))

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()
