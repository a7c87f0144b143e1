"""Prefill GEMMs in bfloat16 over the native kernels' blocks (the q4 mode on a CPU with AMX-BF16 or
AVX512-BF16, engine/kernels/cpu/isa.py).

    scratch = Bf16Scratch()  # one bounded bf16 buffer, shared by every linear
    y = bf16_linear(x, weight, scratch)  # x [M, in] bf16, a NativeQuantLinear -> [M, out] bf16

The weight stays in its Q4_1 / Q8_0 blocks; each call dequantizes it (torch.ops.aigw_cpu.
dequantize_bf16, exact: q * d + m in float32, then rounded to bf16) a tile of output columns at a
time into the scratch and runs F.linear on the tile, which PyTorch sends to oneDNN's bf16 matmul
(AMX tiles or vdpbf16ps, float32 accumulation; the result is rounded to bf16 once).

Why a scratch and not a bf16 copy of every weight: the copy would hold 2 bytes a weight beside the
blocks' ~0.56 (Q4_1) or ~1.06 (Q8_0), ~4.5x a Q4 model's resident bytes, which no memory setting
accounts for; the scratch is at most `SCRATCH_BYTES` (16 MiB) whatever the model. What it costs:
a chunk of M rows dequantizes each weight once (N x K conversions, ~2 bytes written a weight)
against the GEMM's 2 x M x N x K flops, a small share from a few hundred rows on (prompt chunks).

Rows go through the GEMM in tiles of exactly GEMM_ROWS (the last one zero-padded): every call has
one shape per weight tile, so (1) a row's result does not depend on how many rows share the call,
nor where it sits among them (every row is in a full tile of the same primitive; a GEMM's kernel,
its blocking and so its summation order may change with M), which keeps a sequence's output
independent of its batch and of how its prompt was chunked; and (2) oneDNN, which builds and caches
a primitive per shape, holds a few per weight rather than one per chunk length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.native_linear import NativeQuantLinear

SCRATCH_BYTES = 16 << 20  # the dequantized tile's bound (bf16); 8 columns at least
GEMM_ROWS = 64  # rows of every GEMM call (a multiple of AMX's 16-row tiles)


class Bf16Scratch:
    """The one bf16 buffer tiles are dequantized into: allocated at the first call's size, grown
    to at most `max_bytes` (a tile never exceeds it unless 8 columns alone do: K > max_bytes / 16).
    Not shared between threads: a runner's step runs its linears one after another."""

    def __init__(self, max_bytes: int = SCRATCH_BYTES) -> None:
        if max_bytes < 16 * 32:
            raise ValueError(f"a bf16 scratch needs at least 512 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._buffer = torch.empty(0, dtype=torch.bfloat16)

    def columns_per_tile(self, in_features: int) -> int:
        """Output columns (a multiple of 8) of one tile of a weight with `in_features` inputs."""
        return max(8, self.max_bytes // (2 * in_features) // 8 * 8)

    def tile(self, rows: int, in_features: int) -> torch.Tensor:
        """A [rows, in_features] bf16 view of the buffer (overwritten by the next call)."""
        numel = rows * in_features
        if self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=torch.bfloat16)
        return self._buffer[:numel].view(rows, in_features)

    @property
    def nbytes(self) -> int:
        return self._buffer.numel() * 2


def bf16_linear(x: torch.Tensor, weight: NativeQuantLinear, scratch: Bf16Scratch) -> torch.Tensor:
    """x [M, in] bf16 -> x @ W^T [M, out] bf16, W dequantized from `weight`'s blocks tile by
    tile."""
    num_rows, in_features = x.shape
    num_groups = weight.blocks.shape[0]  # 8 output columns each
    padded = -(-num_rows // GEMM_ROWS) * GEMM_ROWS
    if padded != num_rows:
        x = torch.cat([x, x.new_zeros(padded - num_rows, in_features)])  # [padded, in]
    out = x.new_empty(padded, num_groups * 8)  # [padded, out]
    groups_per_tile = scratch.columns_per_tile(in_features) // 8
    for g0 in range(0, num_groups, groups_per_tile):
        g1 = min(num_groups, g0 + groups_per_tile)
        w = scratch.tile((g1 - g0) * 8, in_features)  # [tile columns, in]
        torch.ops.aigw_cpu.dequantize_bf16(weight.blocks, weight.weight_type, g0, g1, w)
        for r0 in range(0, padded, GEMM_ROWS):
            out[r0:r0 + GEMM_ROWS, g0 * 8:g1 * 8] = F.linear(x[r0:r0 + GEMM_ROWS], w)  # [64, tile]
    return out[:num_rows]
