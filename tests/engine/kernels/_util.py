"""Shared helpers for the kernel tests."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# bfloat16 is not tested on CPU: the Triton interpreter mis-handles it here.
DTYPES = [torch.float32, torch.float16]

# On CUDA, tl.dot on float32 inputs uses TF32 (10-bit mantissa), hence the looser float32 bound.
TOLERANCES = {
    torch.float32: 5e-3 if DEVICE == "cuda" else 2e-4,
    torch.float16: 2e-2,
    torch.bfloat16: 5e-2,
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
