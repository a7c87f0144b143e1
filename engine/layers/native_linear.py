"""Linear weights for the native CPU kernels (engine/kernels/cpu): the GGUF's own blocks, every row.

`NativeQuantLinear` holds the file's quantized blocks (Q4_0/Q4_1 at ~0.6 bytes per weight, Q8_0 at
~1.06) and computes every row, prefill or decode, with them: activations are quantized to 8 bits per
32 values (as llama.cpp does) and the block dot products run in 8/16/32-bit integers, ~1.5-2x the
throughput of oneDNN's float32 GEMM on the 2-core AVX2 VM at 8-512 rows, and 4x fewer bytes to read
at one row. Each row's result is independent of the other rows in the call.

Numerics: an approximation of the float model (4-bit weights are the file's; the 8-bit activations
are not), like the rest of the q4 mode.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import cpu as native
from engine.layers.linear import CPU, LinearWeight

NATIVE_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0"})


def to_native_blocks(ggml_type: str, data: np.ndarray) -> tuple[torch.Tensor, int]:
    """Raw rows [out, bytes_per_row] -> (uint8 weight in a kernel layout, kernel weight type).

    Q4_0 (d | 16 nibble bytes, w = (q - 8) d) becomes Q4_1 (d | m | nibbles, w = q d + m) with
    m = -8 d, exact in float16 (a power-of-two multiple). Q4_1 and Q8_0 are then interleaved by 8
    output rows (`interleave_q4_1`, `interleave_q8_0`), so `out` must be a multiple of 8.
    """
    rows = np.ascontiguousarray(data)
    if ggml_type == "Q4_0":
        out_features = rows.shape[0]
        blocks = rows.reshape(out_features, -1, 18)
        d = blocks[..., 0:2].copy().view(np.float16)
        m = (d.astype(np.float32) * -8.0).astype(np.float16)
        converted = np.concatenate([blocks[..., 0:2], m.view(np.uint8), blocks[..., 2:18]], axis=-1)
        rows = np.ascontiguousarray(converted.reshape(out_features, -1))
        ggml_type = "Q4_1"
    if ggml_type == "Q4_1":
        return interleave_q4_1(torch.from_numpy(rows.copy())), native.WEIGHT_TYPES["Q4_1x8"]
    return interleave_q8_0(torch.from_numpy(rows.copy())), native.WEIGHT_TYPES["Q8_0x8"]


class NativeQuantLinear(LinearWeight):
    device, dtype = CPU, torch.float32  # it takes and returns float32

    def __init__(self, blocks: torch.Tensor, weight_type: int,
                 quantized_at_load: bool = False) -> None:
        self.blocks = blocks  # uint8 [out / 8, bytes per 8 rows]: the interleaved blocks
        self.weight_type = weight_type
        # False: the file's own blocks; True: a float weight quantized at load
        # (engine/layers/block_quant.py)
        self.quantized_at_load = quantized_at_load

    @classmethod
    def from_raw(cls, parts: list[tuple[str, np.ndarray]], quantized_at_load: bool = False
                 ) -> NativeQuantLinear:
        """`parts`: (ggml type, raw rows) of the matrices fused (stacked by rows) into one
        weight."""
        converted = [to_native_blocks(t, data) for t, data in parts]
        if len({w for _, w in converted}) != 1:
            raise ValueError("fused parts must share one block type")
        return cls(torch.cat([b for b, _ in converted]), converted[0][1], quantized_at_load)

    @classmethod
    def from_float(cls, weight: torch.Tensor, ggml_type: str) -> NativeQuantLinear:
        """A float [out, in] weight quantized now into `ggml_type` blocks (Q8_0 or Q4_1;
        `block_quant.can_quantize(weight)` must hold)."""
        from engine.layers.block_quant import quantize_rows

        return cls.from_raw([(ggml_type, quantize_rows(weight, ggml_type))], quantized_at_load=True)

    @property
    def block_type(self) -> str:
        """The kernel's block format: "Q4_1" (the file's Q4_0 / Q4_1) or "Q8_0"."""
        return "Q8_0" if self.weight_type == native.WEIGHT_TYPES["Q8_0x8"] else "Q4_1"

    @staticmethod
    def supports(ggml_type: str, out_features: int) -> bool:
        return ggml_type in NATIVE_TYPES and out_features % 8 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.native(x)

    def native(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0
               ) -> torch.Tensor:
        """x [M, in] float32 (RMS-normalised with `norm_weight` first when given) -> [M, out]."""
        return torch.ops.aigw_cpu.q_linear(x, self.blocks, self.weight_type, norm_weight, eps,
                                           False)

    def silu_mul_native(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, 2 * in] -> (silu(x[:, :in]) * x[:, in:]) @ W^T [M, out], one op."""
        return torch.ops.aigw_cpu.q_linear(x, self.blocks, self.weight_type, None, 0.0, True)

    def add_into(self, residual: torch.Tensor, x: torch.Tensor, silu_and_mul: bool = False) -> None:
        """residual += x @ W^T in place; x = silu(x[:, :in]) * x[:, in:] first when
        `silu_and_mul`."""
        torch.ops.aigw_cpu.q_linear_add_(residual, x, self.blocks, self.weight_type, silu_and_mul)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


def interleave_q4_1(rows: torch.Tensor) -> torch.Tensor:
    """Q4_1 rows [N, nb * 20] -> the kernel's 8-column layout [N / 8, nb * 160] (decode_ops.cpp
    dot_q4x8): per 8 columns and block, d f16[8] | m f16[8] | 4 x 32 nibble bytes where byte 4j + i
    of vector t holds column j's input 8t + i (low nibble) and 8t + 4 + i (high nibble)."""
    data = rows.numpy()
    n = data.shape[0]
    blocks = data.reshape(n // 8, 8, -1, 20)  # [G, j, b, 20]
    nb = blocks.shape[2]
    nibbles = blocks[..., 4:20]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [G, j, b, 32], input k at k
    c = codes.reshape(n // 8, 8, nb, 4, 2, 4)  # k = 8t + 4h + i -> [G, j, b, t, h, i]
    packed = (c[..., 0, :] | (c[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4)  # [G, b, t, j, i]
    # [G, b, d|m, j, 2]
    scales = blocks[..., 0:4].reshape(n // 8, 8, nb, 2, 2).transpose(0, 2, 3, 1, 4)
    out = np.concatenate([scales.reshape(n // 8, nb, 32), packed.reshape(n // 8, nb, 128)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out.reshape(n // 8, nb * 160)))


def interleave_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """Q8_0 rows [N, nb * 34] -> the kernel's 8-column layout [N / 8, nb * 272] (decode_ops.cpp
    dot_q8x8): per 8 columns and block, d f16[8] | 8 x 32 int8 where byte 4j + i of vector u holds
    column j's input 4u + i."""
    data = rows.numpy()
    n = data.shape[0]
    blocks = data.reshape(n // 8, 8, -1, 34)  # [G, j, b, 34]
    nb = blocks.shape[2]
    scales = blocks[..., 0:2].transpose(0, 2, 1, 3).reshape(n // 8, nb, 16)  # [G, b, j * 2]
    # [G, b, u, j, i]
    values = blocks[..., 2:34].reshape(n // 8, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4)
    out = np.concatenate([scales, values.reshape(n // 8, nb, 256)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out.reshape(n // 8, nb * 272)))
