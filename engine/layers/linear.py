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


def fuse_rows(weights: list[torch.Tensor]) -> torch.Tensor:
    """Stack [out_i, in] matrices into one [sum(out_i), in] so one GEMM computes all of them."""
    return torch.cat(weights, dim=0)
