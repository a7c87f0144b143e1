"""Float weights -> GGML blocks at load, for the native CPU kernels
(engine/layers/native_linear.py).

A float checkpoint (safetensors, or a GGUF block type the kernels do not read) takes the CPU's
default path by quantizing each linear weight here once, into the rows a GGUF file would hold:

    Q8_0  d f16 | 32 x int8        w = q * d,      d = max|w| / 127 over the block's 32 inputs
    Q4_1  d f16 | m f16 | 16 bytes w = q * d + m,  d = (max - min) / 15, m = min, q in 0..15
          (low nibbles = inputs 0..15, high nibbles = 16..31, as ggml lays them out)

Rounding is to nearest with the stored (float16) scale, so a code never points past the block's
range by more than the clamp allows. These are llama.cpp's reference quantizers (no importance
matrix): Q8_0 keeps ~2.5 significant digits per weight (near-lossless, llama.cpp's own view),
Q4_1 sixteen levels per block.

`mxfp4_to_q8_0` re-blocks MXFP4 experts (gpt-oss) exactly: every e2m1 value times 2 is an integer
in -12..12, so with d = 2^(scale - 128) the Q8_0 codes reproduce each weight bit for bit (where d
is a float16 normal or subnormal: 2^-24 <= d <= 2^15, which released checkpoints' scales are;
other groups are quantized from their float values like any weight).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.layers.mxfp4 import GROUP_SIZE, SCALE_BIAS, dequantize_mxfp4

QK = 32  # inputs per block
LOAD_TYPES = ("Q8_0", "Q4_1")


def can_quantize(weight: torch.Tensor) -> bool:
    """A [N, K] float weight the native kernels can take: K in blocks of 32, N in groups of 8."""
    return weight.dim() == 2 and weight.shape[1] % QK == 0 and weight.shape[0] % 8 == 0


def quantize_rows(weight: torch.Tensor, ggml_type: str) -> np.ndarray:
    """weight [N, K] float -> uint8 [N, K / 32 * block bytes]: the GGML rows of `ggml_type`."""
    if ggml_type == "Q8_0":
        return _q8_0(weight)
    if ggml_type == "Q4_1":
        return _q4_1(weight)
    raise ValueError(f"no load-time quantizer for {ggml_type!r} (one of {', '.join(LOAD_TYPES)})")


def _q8_0(weight: torch.Tensor) -> np.ndarray:
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // QK, QK)  # [N, B, 32]
    d = (blocks.abs().amax(dim=-1, keepdim=True) / 127.0).half()  # [N, B, 1] as stored
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    codes = torch.round(blocks * inv).clamp_(-127, 127).to(torch.int8)  # [N, B, 32]
    return _pack(n, [d.view(torch.uint8).view(n, -1, 2), codes.view(torch.uint8)])


def _q4_1(weight: torch.Tensor) -> np.ndarray:
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // QK, QK)  # [N, B, 32]
    low, high = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)  # [N, B, 1]
    d, m = ((high - low) / 15.0).half(), low.half()
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    codes = torch.round((blocks - m.float()) * inv).clamp_(0, 15).to(torch.uint8)  # [N, B, 32]
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)  # [N, B, 16]
    return _pack(n,
                 [d.view(torch.uint8).view(n, -1, 2), m.view(torch.uint8).view(n, -1, 2), nibbles])


def _pack(n: int, fields: list[torch.Tensor]) -> np.ndarray:
    """Per-block fields [N, B, bytes_i] -> rows [N, B * sum(bytes_i)] uint8."""
    return np.ascontiguousarray(torch.cat(fields, dim=-1).reshape(n, -1).numpy())


def mxfp4_to_q8_0(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """One MXFP4 matrix (blocks uint8 [N, G, 16], scales uint8 [N, G]) -> Q8_0 rows [N, G * 34],
    exact where the scale fits a float16 (module docstring)."""
    n, groups = scales.shape
    # [N, G, 32]
    values = dequantize_mxfp4(blocks, scales, torch.float32).view(n, groups, GROUP_SIZE)
    exponent = scales.to(torch.int32) - SCALE_BIAS - 1  # d = 2^(scale - 128): codes = 2 * e2m1
    exact = ((exponent >= -24) & (exponent <= 15)).unsqueeze(-1)  # [N, G, 1]
    d = torch.ldexp(torch.ones(n, groups, 1), exponent.unsqueeze(-1))  # [N, G, 1] float32
    codes = torch.round(values / d).clamp_(-127, 127)
    fallback = torch.from_numpy(_q8_0(values.reshape(n, -1))).view(n, groups, 34)
    rows = _pack(n, [d.half().view(torch.uint8).view(n, groups, 2),
                     codes.to(torch.int8).view(torch.uint8)])
    packed = torch.from_numpy(rows).view(n, groups, 34)
    return np.ascontiguousarray(torch.where(exact, packed, fallback).reshape(n, -1).numpy())
