"""Linear weights in the forms the runner can hold them: dense, 4-bit groups (from GGUF Q4_0/Q4_1), FP8.

Each form is a callable `x [T, in] -> [T, out]`; the model does not know which one it has.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F


class LinearWeight(abc.ABC):
    @abc.abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    @abc.abstractmethod
    def nbytes(self) -> int: ...


class DenseLinear(LinearWeight):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.contiguous()  # [out, in]
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class OneDNNLinear(LinearWeight):
    """Float32 weight prepacked for oneDNN (CPU): ~1.4x the GEMM throughput of the default BLAS path at
    decode batch sizes on AVX2 CPUs, and every row's result independent of how many rows are in the
    batch (the default path differs between one row and several)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 batch_size_hint: int = 32) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_size_hint)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 4

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @staticmethod
    def is_available(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.float32
                and torch.backends.mkldnn.is_available())


def fuse_rows(weights: list[torch.Tensor]) -> torch.Tensor:
    """Stack [out_i, in] matrices into one [sum(out_i), in] so one GEMM computes all of them."""
    return torch.cat(weights, dim=0)
