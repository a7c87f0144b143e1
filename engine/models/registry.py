"""Model registry: architecture name -> how to build it."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.layers.attention import PagedAttentionBackend
from engine.models.llama import CPU, LinearFactory, LlamaModel

_DENSE = {"llama", "mistral", "qwen2", "smollm"}
_MOE = {"mixtral", "qwen2_moe", "olmoe"}


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], attention: PagedAttentionBackend,
                make_linear: LinearFactory, device: torch.device = CPU,
                dtype: torch.dtype = torch.float32) -> LlamaModel:
    arch = config.architecture
    if arch in _DENSE:
        return LlamaModel(config, weights, attention, make_linear, device=device, dtype=dtype)
    if arch in _MOE:
        from engine.models.moe import moe_mlp_factory

        return LlamaModel(config, weights, attention, make_linear, mlp_factory=moe_mlp_factory,
                          device=device, dtype=dtype)
    raise ValueError(f"unsupported architecture {arch!r} (supported: {sorted(_DENSE | _MOE)})")
