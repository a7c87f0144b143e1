"""Linear weights for the native CPU decode kernels (engine/kernels/cpu): the GGUF's own blocks.

`NativeQuantLinear` keeps a weight twice: the file's quantized blocks (Q4_0/Q4_1/Q8_0, ~0.6 or ~1.06
bytes per weight) for decode rows, and the dense float32 weight (oneDNN-prepacked) for prefill rows
and large decode batches, where a float GEMM is faster than the integer dot products. Decode rows
take the blocks only while a step has at most `MAX_NATIVE_ROWS` of them.

Numerics: decode activations are quantized to 8 bits per 32 values (as llama.cpp does), so this is
an approximation of the float model, like the rest of the q4 mode.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import cpu as native
from engine.layers.attention import current_metadata
from engine.layers.linear import DenseLinear, LinearWeight, OneDNNLinear

# Past this many decode rows the float32 GEMM wins.
MAX_NATIVE_ROWS = 8
NATIVE_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0"})


def to_native_blocks(ggml_type: str, data: np.ndarray) -> tuple[torch.Tensor, int]:
    """Raw rows [out, bytes_per_row] -> (uint8 weight in a kernel layout, kernel weight type).

    Q8_0 rows stay as stored. Q4_0 (d | 16 nibble bytes, w = (q - 8) d) becomes Q4_1 (d | m |
    nibbles, w = q d + m) with m = -8 d, exact in float16 (a power-of-two multiple); Q4_1 is then
    interleaved by 8 output rows (`interleave_q4_1`), so `out` must be a multiple of 8.
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
    return torch.from_numpy(rows.copy()), native.WEIGHT_TYPES[ggml_type]


class NativeQuantLinear(LinearWeight):
    def __init__(self, dense: torch.Tensor, blocks: torch.Tensor, weight_type: int,
                 rows_are_decodes: bool = False) -> None:
        """`rows_are_decodes`: every input row counts as a decode row (the lm head, which runs on
        the sampled rows after the step's forward pass); otherwise the step's metadata says."""
        self.dense = OneDNNLinear(dense) if OneDNNLinear.is_available(dense) else DenseLinear(dense)
        self.blocks = blocks  # uint8, [out, bytes_per_row] (Q8_0) or [out / 8, ...] (Q4_1 x 8)
        self.weight_type = weight_type
        self.rows_are_decodes = rows_are_decodes

    @classmethod
    def from_raw(cls, dense: torch.Tensor, parts: list[tuple[str, np.ndarray]],
                 rows_are_decodes: bool = False) -> NativeQuantLinear:
        """`parts`: (ggml type, raw rows) of the matrices fused (stacked by rows) into `dense`."""
        converted = [to_native_blocks(t, data) for t, data in parts]
        if len({w for _, w in converted}) != 1:
            raise ValueError("fused parts must share one block type")
        return cls(dense, torch.cat([b for b, _ in converted]), converted[0][1], rows_are_decodes)

    @staticmethod
    def supports(ggml_type: str, out_features: int) -> bool:
        return ggml_type in NATIVE_TYPES and (ggml_type == "Q8_0" or out_features % 8 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        num_decode = x.shape[0] if self.rows_are_decodes else current_metadata().num_decode_tokens
        if num_decode == 0 or num_decode > MAX_NATIVE_ROWS:
            return self.dense(x)
        decoded = self.native(x[:num_decode])
        if num_decode == x.shape[0]:
            return decoded
        return torch.cat([decoded, self.dense(x[num_decode:])])

    def native(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0
               ) -> torch.Tensor:
        """x [M, in] float32 (RMS-normalised with `norm_weight` first when given) -> [M, out]."""
        return torch.ops.aigw_cpu.q_linear(x, self.blocks, self.weight_type, norm_weight, eps, False)

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes + self.blocks.numel()


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
    scales = blocks[..., 0:4].reshape(n // 8, 8, nb, 2, 2).transpose(0, 2, 3, 1, 4)  # [G, b, d|m, j, 2]
    out = np.concatenate([scales.reshape(n // 8, nb, 32), packed.reshape(n // 8, nb, 128)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out.reshape(n // 8, nb * 160)))
