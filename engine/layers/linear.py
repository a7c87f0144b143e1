"""Linear weights in the forms the runner can hold them: dense, 4-bit groups (from GGUF Q4_0/Q4_1),
FP8.

Each form is a callable `x [T, in] -> [T, out]`; the model does not know which one it has.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F

CPU = torch.device("cpu")


class LinearWeight(abc.ABC):
    """One form of a linear layer's weight: x [T, in] -> [T, out] on `device`, taking and
    returning `dtype` (the compute dtype); the CPU kernels' forms state CPU and float32 as class
    attributes."""

    device: torch.device
    dtype: torch.dtype

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

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return self.weight.device

    @property  # type: ignore[override]
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


MAX_EXACT_ROWS = 16  # row counts up to this run as they are; above it, 8 buckets per doubling


def row_bucket(num_rows: int) -> int:
    """The row count a oneDNN GEMM of `num_rows` rows runs at: `num_rows` up to MAX_EXACT_ROWS,
    else rounded up to a multiple of 2**(bit_length - 4) (under 12.5% padding, 8 sizes per
    doubling: 88 sizes up to 8192 rows).

    oneDNN builds (JIT-compiles) a primitive per input shape and keeps it in two caches (ideep's
    and its own, 1,024 entries each), about 0.55 MiB each: an engine whose token count changes
    every step would fill them with a primitive per count it ever saw (~1.1 GiB), and churn them
    past that. Bucketed, a model's primitives are a few per linear shape and created once. (Not
    inside a torch.compile graph, whose row count is symbolic: it runs as it is.)"""
    if num_rows <= MAX_EXACT_ROWS:
        return num_rows
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


def _rows_padded(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x [T, in] with zero rows appended up to num_rows."""
    padded = x.new_zeros((num_rows, x.shape[1]))  # [num_rows, in]
    padded[: x.shape[0]] = x
    return padded


class OneDNNLinear(LinearWeight):
    """Float32 weight prepacked for oneDNN (CPU): ~1.4x the GEMM throughput of the default BLAS path
    at decode batch sizes on AVX2 CPUs, and every row's result independent of how many rows are in
    the batch (the default path differs between one row and several). Row counts are bucketed
    (`row_bucket`), so the set of oneDNN primitives, and the memory they hold, stays bounded."""

    device, dtype = CPU, torch.float32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 batch_size_hint: int = 32) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_size_hint)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # [..., in]: the rows are every leading index
            return self(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        num_rows = x.shape[0]  # x [T, in]
        bucket = num_rows if torch.compiler.is_compiling() else row_bucket(num_rows)
        if bucket != num_rows:
            x = _rows_padded(x, bucket)  # [bucket, in]
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out if bucket == num_rows else out[:num_rows]  # [T, out]

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual [T, out] + x [T, in] @ W^T, as one oneDNN call (a fused add)."""
        num_rows = x.shape[0]
        bucket = num_rows if torch.compiler.is_compiling() else row_bucket(num_rows)
        if bucket == num_rows:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias,
                                                             "add")
        out = torch.ops.mkldnn._linear_pointwise.binary(
            _rows_padded(x, bucket), _rows_padded(residual, bucket), self.packed, self.bias,
            "add")  # [bucket, out]
        return out[:num_rows]

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 4

    @staticmethod
    def is_available(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.float32
                and torch.backends.mkldnn.is_available())


def fuse_rows(weights: list[torch.Tensor]) -> torch.Tensor:
    """Stack [out_i, in] matrices into one [sum(out_i), in] so one GEMM computes all of them."""
    return torch.cat(weights, dim=0)
