"""FP8BlockLinear: a linear weight kept as a block-scaled FP8 checkpoint stores it (never
re-quantized).

    wq [N, K] float8_e4m3fn, w_scale [ceil(N/Bn), ceil(K/Bk)] fp32:  w[n, k] ~= wq[n, k] * w_scale[n
                                                                     // Bn, k // Bk]

Each call goes through engine/kernels/fp8_block.py: on GPUs with FP8 tensor cores (compute
capability >= 8.9) the activations are quantized per token and K block and the block-scaled w8a8
Triton GEMM runs; elsewhere the weight is dequantized per call (weight-only). Output in the input's
dtype. `concat` joins the parts of a fused projection (q/k/v, gate/up) along N: each part but the
last must span whole N blocks, so every block of the joined weight keeps one scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kernels.fp8 import FP8_DTYPE
from engine.kernels.fp8_block import (
    dequantize_blocks,
    fp8_block_linear_w8a8,
    fp8_block_linear_weight_only,
)
from engine.layers.linear import LinearWeight


def can_run_w8a8(device: torch.device) -> bool:
    """The block-scaled FP8 kernel runs natively here (CUDA with FP8 tensor cores)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class FP8BlockLinear(LinearWeight):
    def __init__(self, wq: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                 dtype: torch.dtype) -> None:
        n, k = wq.shape
        expected = (-(-n // block[0]), -(-k // block[1]))
        if wq.dtype != FP8_DTYPE or tuple(w_scale.shape) != expected:
            raise ValueError(f"need wq [N, K] {FP8_DTYPE} and w_scale {expected}, got {wq.dtype} "
                             f"{tuple(wq.shape)} / {tuple(w_scale.shape)}")
        self.wq = wq.contiguous()  # [N, K]
        self.w_scale = w_scale.float().contiguous()  # [Nb, Kb]
        self.block = block
        self.dtype = dtype  # the compute (activation and output) dtype

    @classmethod
    def concat(cls, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], block: tuple[int, int],
               dtype: torch.dtype) -> FP8BlockLinear | None:
        """The parts (wq, w_scale) joined along N, or None when a part but the last ends inside
        an N block (its rows would share a block scale with the next part's)."""
        if any(wq.shape[0] % block[0] for wq, _ in parts[:-1]):
            return None
        return cls(torch.cat([wq for wq, _ in parts]), torch.cat([s for _, s in parts]), block,
                   dtype)

    @property
    def device(self) -> torch.device:
        return self.wq.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if can_run_w8a8(x.device):
            return fp8_block_linear_w8a8(x, self.wq, self.w_scale, self.block)
        return fp8_block_linear_weight_only(x, self.wq, self.w_scale, self.block)

    def dequantize(self) -> torch.Tensor:
        """The weight the layer computes with, [N, K] in the compute dtype."""
        return dequantize_blocks(self.wq, self.w_scale, self.block, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.wq.numel() * self.wq.element_size() + self.w_scale.numel() * 4
