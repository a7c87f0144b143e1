"""Model building blocks, and the factories that pick their implementation per device.

CPU: PyTorch implementations (the references). CUDA: Triton kernels from engine/kernels.
`AIGW_KERNELS=triton|torch` forces one (see engine.kernels.kernel_backend).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.layers.linear import LinearWeight


def attention_backend_name(device: torch.device) -> str:
    forced = os.environ.get("AIGW_KERNELS")
    if forced in ("triton", "torch"):
        return forced
    return "triton" if device.type == "cuda" else "torch"


def make_linear_factory(config: EngineConfig, device: torch.device, raw_weights: dict):  # type: ignore[no-untyped-def]
    """(hf_name, dense weight) -> LinearWeight, in the engine's dtype and quantization."""
    from engine.layers.linear import DenseLinear

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[config.resolved_dtype]

    def make(name: str, weight: torch.Tensor) -> LinearWeight:
        if config.quantization == "fp8" and name != "lm_head.weight":
            from engine.layers.fp8_linear import FP8Linear

            return FP8Linear.from_dense(weight.to(device), dtype)
        return DenseLinear(weight.to(device=device, dtype=dtype))

    return make
