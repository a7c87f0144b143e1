"""Checks shared by the Triton launchers (no Triton import here)."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET once, when it is first imported; so do we (not per launch).
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`, tests only)."""
    return INTERPRETING


def check_same_device(*tensors: torch.Tensor) -> None:
    """Assert all tensors share one device that a Triton kernel can run on."""
    device = tensors[0].device
    for t in tensors:
        assert t.device == device, f"tensors on {t.device} and {device}"
    assert device.type == "cuda" or interpreting(), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}"
    )


def check_row_major(t: torch.Tensor, name: str) -> None:
    """Assert the last dim is unit-stride (rows may be strided)."""
    assert t.stride(-1) == 1, f"{name} must have a unit-stride last dim, strides {t.stride()}"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
