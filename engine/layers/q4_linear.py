"""4-bit decode path: run decode tokens through the GGUF file's own Q4_0/Q4_1 weights.

On this class of CPU a decode step is bound by reading the weights: float32 weights cost ~4x the
bytes of the file's 4-bit blocks. `Q4DecodeLinear` repacks each Q4 block (32 weights sharing a scale
and a minimum) into PyTorch's int4 CPU format (`_weight_int4pack_mm_for_cpu`, group size 32, exact:
the 4-bit codes and the group parameters are the file's own), and runs decode rows through it with
bfloat16 activations. Prefill rows keep the dense float32 weight (GEMMs are faster there), so the
row a token takes depends only on whether it is a decode token, never on what else is in the batch.

Q4_1 block (20 bytes): d f16 | m f16 | 16 bytes of nibbles (low nibbles = weights 0..15,
    high = 16..31), w = q * d + m. int4pack wants w = (q - 8) * scale + zero
    ->  scale = d, zero = m + 8d
Q4_0 block (18 bytes): d f16 | 16 bytes of nibbles, w = (q - 8) * d   ->  scale = d, zero = 0
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.layers.attention import current_metadata
from engine.layers.linear import CPU, DenseLinear, LinearWeight, OneDNNLinear

GROUP_SIZE = 32
# The int4 CPU kernel is a GEMV at heart: past a few rows the float GEMM is faster (measured: batch
# 32 decode 297 ms/step in int4 vs 194 ms in float32), so bigger decode batches take the dense
# weight.
MAX_INT4_ROWS = 8
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
SUPPORTED_TYPES = frozenset(_BLOCK_BYTES)


def unpack_q4_blocks(ggml_type: str, data: np.ndarray, shape: tuple[int, int]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw blocks of an [out, in] weight -> (codes [out, in] int32 in 0..15, scale [out, in/32],
    zero [out, in/32]) with w = (codes - 8) * scale + zero, all exact in float32."""
    out_features, in_features = shape
    num_groups = in_features // GROUP_SIZE
    blocks = np.ascontiguousarray(data).reshape(out_features, num_groups, _BLOCK_BYTES[ggml_type])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [out, groups]
    if ggml_type == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:20]
        zero = m + 8.0 * d
    else:
        nibbles = blocks[..., 2:18]
        zero = np.zeros_like(d)
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [out, groups, 32]
    return (torch.from_numpy(codes.reshape(out_features, in_features).astype(np.int32)),
            torch.from_numpy(d), torch.from_numpy(zero))


class Q4DecodeLinear(LinearWeight):
    device, dtype = CPU, torch.float32  # the CPU's int4 GEMM, float32 in and out

    def __init__(self, dense: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor) -> None:
        self.dense = OneDNNLinear(dense) if OneDNNLinear.is_available(dense) else DenseLinear(dense)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        # [in/32, out, 2] (scale, zero) in the activation dtype, as the kernel wants
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()],
                                            dim=-1).to(torch.bfloat16).contiguous()

    @classmethod
    def from_raw(cls, dense: torch.Tensor, parts: list[tuple[str, np.ndarray, tuple[int, int]]]
                 ) -> Q4DecodeLinear:
        """`parts` are the raw blocks of the matrices fused (stacked by rows) into `dense`."""
        unpacked = [unpack_q4_blocks(t, data, shape) for t, data, shape in parts]
        codes, scale, zero = (torch.cat([u[i] for u in unpacked], dim=0) for i in range(3))
        return cls(dense, codes, scale, zero)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        num_decode = current_metadata().num_decode_tokens
        if num_decode == 0 or num_decode > MAX_INT4_ROWS:
            return self.dense(x)
        decoded = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x[:num_decode].to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_and_zeros
        ).to(x.dtype)
        if num_decode == x.shape[0]:
            return decoded
        return torch.cat([decoded, self.dense(x[num_decode:])])

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes + self.packed.numel() + self.scales_and_zeros.numel() * 2


class BF16Linear(LinearWeight):
    """The q4 mode's lm head (the file stores it as 8-bit Q8_0): bfloat16 for a few rows (a GEMV,
    bound by reading the weight), the float32 weight for more (bf16 GEMMs are slow without native
    bf16 instructions)."""

    device, dtype = CPU, torch.float32

    def __init__(self, dense: torch.Tensor) -> None:
        self.weight = dense.to(torch.bfloat16).contiguous()
        self.dense = OneDNNLinear(dense) if OneDNNLinear.is_available(dense) else DenseLinear(dense)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > MAX_INT4_ROWS:
            return self.dense(x)
        return F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 2 + self.dense.nbytes
