"""FP8Linear: a linear weight stored in float8_e4m3fn with one fp32 scale per output channel.

    wq [N, K] float8_e4m3fn, w_scale [N] fp32:   w ~= wq * w_scale[:, None]

Quantized once at load (`from_dense`). Each call goes through `engine.kernels.fp8_linear`: on the
CPU (and GPUs without FP8 tensor cores) the weight is dequantized per call (weight-only); on Hopper
/ Ada the activations are quantized per token and the w8a8 Triton GEMM runs. Output in the input's
dtype.
"""

from __future__ import annotations

import torch

from engine import kernels
from engine.kernels.fp8 import FP8_DTYPE, quantize_weight_per_channel
from engine.layers.linear import LinearWeight


class FP8Linear(LinearWeight):
    def __init__(self, wq: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> None:
        if wq.dtype != FP8_DTYPE or wq.dim() != 2 or w_scale.shape != (wq.shape[0],):
            raise ValueError(f"need wq [N, K] {FP8_DTYPE} and w_scale [N], got {wq.dtype} "
                             f"{tuple(wq.shape)} / {tuple(w_scale.shape)}")
        self.wq = wq.contiguous()  # [N, K]
        self.w_scale = w_scale.float().contiguous()  # [N]
        self.dtype = dtype  # the compute (activation and output) dtype
        self.bias = bias.to(dtype) if bias is not None else None

    @classmethod
    def from_dense(cls, weight: torch.Tensor, dtype: torch.dtype,
                   bias: torch.Tensor | None = None) -> FP8Linear:
        """Quantize `weight` [N, K] (any float dtype, on its device) per output channel."""
        wq, w_scale = quantize_weight_per_channel(weight)
        return cls(wq, w_scale, dtype, bias)

    @property
    def device(self) -> torch.device:
        return self.wq.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.fp8_linear(x, self.wq, self.w_scale, self.bias)

    def dequantize(self) -> torch.Tensor:
        """The weight the layer computes with, [N, K] in the compute dtype."""
        return (self.wq.float() * self.w_scale[:, None]).to(self.dtype)

    @property
    def nbytes(self) -> int:
        size = self.wq.numel() * self.wq.element_size() + self.w_scale.numel() * 4
        return size + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)
